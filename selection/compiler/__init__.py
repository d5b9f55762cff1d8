"""SelIR's compiler: what runs at startup (and in `detent solve` / `detent tuple`),
never per step. The language (`lang`) and its reference interpreter
(`interp`), lowering to an SSA graph (`lower`, `lower_expr`, `lower_stmt`,
`ir`), the cut (`cut`), legal values (`vra`), compiled selectors (`codegen`,
`solver`), the JIT cache (`jitcache`), the commitment tuple (`commitment`)
and the default profile (`profile`). The per-step runtime (ops, context,
dispatch) sits in selection/ and calls only the selectors this package built.
"""

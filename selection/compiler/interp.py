"""Reference interpreter: runs a SelIR program on concrete inputs with
Python's own semantics (the program is executed as the Python it is). The
compiler's output is tested against it."""
from __future__ import annotations

from typing import Any

from detent.selection.compiler import lang


def run(prog: "lang.Program", inputs: dict[str, Any], knobs: dict[str, Any] | None = None,
        entry: str | None = None) -> Any:
    """Run the entry function (or `entry`) with `inputs` (facts and runtime
    values by name); `knobs` overrides knob defaults. require/assume failures
    raise SelectionError."""
    knobs = dict(knobs or {})
    ns: dict[str, Any] = {"__name__": f"selir_{prog.name}"}
    code = compile(prog.source, prog.filename, "exec")
    exec(code, ns)

    def knob(name, choices, default):
        v = knobs.get(name, default)
        if v not in tuple(choices):
            raise lang.SelectionError(f"knob {name!r} = {v!r} is not one of {tuple(choices)}")
        return v

    ns.update(lang.BUILTINS)
    ns.update(knob=knob, require=lang.require, assume=lang.assume, cdiv=lang.cdiv, log2=lang.log2,
              next_pow2=lang.next_pow2, round_up=lang.round_up)
    fn_name = entry or prog.entry.name
    fn = ns[fn_name]
    names = [a.arg for a in (prog.functions[fn_name].args.args)]
    missing = [n for n in names if n not in inputs]
    if missing:
        raise lang.SelIRError(f"program {prog.name!r}: no value for input(s) {missing}")
    return fn(**{n: inputs[n] for n in names})

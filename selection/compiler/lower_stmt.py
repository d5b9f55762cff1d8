"""Statement lowering for SelIR (split from lower.py): blocks with their path
conditions, conditionals merged with ``phi`` nodes, static ``for`` unrolling,
assignment, ``require``/``assume`` checks, and a function's value as the
first-match chain of its returns. Mixed into
:class:`detent.selection.compiler.lower.Lowerer`.
"""
from __future__ import annotations

import ast
from typing import Any

from detent.selection.compiler import lang
from detent.selection.compiler.ir import Check
from detent.selection.compiler.lower_expr import _BIN, TupleV


class _Bind(ast.stmt):
    """Synthetic statement: bind a loop target to one element of a static collection."""
    _fields = ()

    def __init__(self, target: ast.expr, value: Any, lineno: int):
        super().__init__()
        self.target, self.value, self.lineno, self.col_offset = target, value, lineno, 0


class StmtLowering:
    """Statements and functions of :class:`~detent.selection.compiler.lower.Lowerer`."""

    # ---- statements
    # A block runs with (env, live): live is the path condition under which
    # execution reaches this point (the guard of checks). Each `return` adds
    # (pc, value) to the function's return list, pc being the conjunction of
    # the enclosing conditions since the function's entry; the function's
    # value is the first-match chain over that list in program order, which
    # is Python's semantics without duplicating the rest of the function.
    def block(self, stmts: list, env: dict, live: int, pc: int, rets: list) -> tuple[dict, int, bool]:
        """Run stmts; returns (env, live, terminated)."""
        g = self.g
        for s in stmts:
            g.cur_line = getattr(s, "lineno", g.cur_line)
            if isinstance(s, ast.Return):
                rets.append((pc, self.expr(s.value, env, live), s))
                return env, g.const(False), True
            if isinstance(s, ast.If):
                c = self.cond(s.test, env, live)
                if g.is_const(c):
                    env, live, term = self.block(s.body if g.value(c) else s.orelse, env, live, pc, rets)
                    if term:
                        return env, live, True
                    continue
                nc = g.lnot(c)
                ea, la, ta = self.block(s.body, dict(env), g.land(live, c), g.land(pc, c), rets)
                eb, lb, tb = self.block(s.orelse, dict(env), g.land(live, nc), g.land(pc, nc), rets)
                if ta and tb:
                    return env, g.const(False), True
                if ta:
                    env, live = eb, lb
                    continue
                if tb:
                    env, live = ea, la
                    continue
                # in insertion order: a set's order varies by process (str hashes) and would renumber
                # the graph, and the JIT cache names pins by node id
                for k in list(ea) + [k for k in eb if k not in ea]:
                    if k in ea and k in eb:
                        env[k] = ea[k] if ea[k] is eb[k] else self.merge(c, ea[k], eb[k], s)
                    else:
                        env.pop(k, None)  # defined on one path only: using it is an error
                live = g.phi(c, la, lb)
                continue
            if isinstance(s, ast.For):
                env, live, term = self.block(self.unroll(s, env, live), env, live, pc, rets)
                if term:
                    return env, live, True
                continue
            if isinstance(s, _Bind):
                self.assign(s.target, s.value, env, s)
                continue
            self.simple(s, env, live)
        return env, live, False

    def function(self, fn: ast.FunctionDef, env: dict, live: int) -> Any:
        """Lower a function body to its return value."""
        g = self.g
        rets: list = []
        env, end_live, term = self.block(fn.body, env, live, g.const(True), rets)
        if not rets or not (term or (g.is_const(end_live) and not g.value(end_live))):
            raise lang.SelIRError(f"{self.p.filename}:{fn.lineno}: function {fn.name!r} can end without a "
                                  "return (make the last statement a return, or use else)")
        res = rets[-1][1]
        for pcond, v, at in reversed(rets[:-1]):
            res = self.merge(pcond, v, res, at) if not g.is_const(pcond) else (v if g.value(pcond) else res)
        return res

    def unroll(self, s: ast.For, env: dict, guard: int) -> list:
        it = s.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
            args = [self.expr(a, env, guard) for a in it.args]
            if not all(isinstance(a, int) and self.g.is_const(a) for a in args):
                self.err(s, "for loop over range() with bounds not constant for these facts: loop over a static "
                            "range and guard the body with an if")
            items = list(range(*(self.g.value(a) for a in args)))
        elif isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute):
            base = self.expr(it.func.value, env, guard)
            if not (isinstance(base, int) and self.g.is_const(base) and isinstance(self.g.value(base), dict)):
                self.err(s, f".{it.func.attr}() of a non-constant dict")
            items = list(getattr(self.g.value(base), it.func.attr)())
        else:
            v = self.expr(it, env, guard)
            if isinstance(v, TupleV):
                items = list(v.items)
                out: list = []
                for x in items:
                    out.append(_Bind(s.target, x, s.lineno))
                    out.extend(s.body)
                return out
            if not (isinstance(v, int) and self.g.is_const(v)):
                self.err(s, "for loop over a collection that is not static for these facts")
            items = list(self.g.value(v))
        if len(items) > 4096:
            self.err(s, f"for loop unrolls to {len(items)} iterations (limit 4096)")
        out = []
        for x in items:
            out.append(_Bind(s.target, self.g.const(x), s.lineno))
            out.extend(s.body)
        return out

    def assign(self, target: ast.expr, v: Any, env: dict, at: ast.AST) -> None:
        g = self.g
        if isinstance(target, ast.Name):
            env[target.id] = v
            if isinstance(v, int) and g.ops[v] not in ("const", "input"):
                g.label(v, target.id)
            return
        elts = target.elts
        if isinstance(v, TupleV):
            if len(v.items) != len(elts):
                self.err(at, f"cannot unpack {len(v.items)} values into {len(elts)} names")
            items = v.items
        elif isinstance(v, int):
            if g.is_const(v):
                val = g.value(v)
                try:
                    vals = tuple(val)
                except TypeError:
                    self.err(at, f"cannot unpack {val!r}")
                if len(vals) != len(elts):
                    self.err(at, f"cannot unpack {len(vals)} values into {len(elts)} names")
                items = tuple(g.const(x) for x in vals)
            else:
                items = tuple(g.op("index", v, g.const(j)) for j in range(len(elts)))
        else:
            self.err(at, "cannot unpack this value")
        for t, x in zip(elts, items):
            self.assign(t, x, env, at)

    def simple(self, s: ast.stmt, env: dict, guard: int) -> None:
        g = self.g
        if isinstance(s, ast.Assign):
            v = self.expr(s.value, env, guard)
            for t in s.targets:
                self.assign(t, v, env, s)
        elif isinstance(s, ast.AugAssign):
            cur = self.lookup(s.target, env)
            v = g.op(_BIN[type(s.op)], self.node(cur, s), self.node(self.expr(s.value, env, guard), s))
            self.assign(s.target, v, env, s)
        elif isinstance(s, ast.Expr):
            call = s.value
            if isinstance(call, ast.Constant):
                return
            kind = call.func.id
            if id(s) in self._domain_stmts and g.ranges_on:
                g.ranges_on = False  # the domain's own bounds must stay checked at run time
                try:
                    c = self.cond(call.args[0], env, guard)
                finally:
                    g.ranges_on = True
            else:
                c = self.cond(call.args[0], env, guard)
            msg = ""
            if len(call.args) > 1:
                m = self.expr(call.args[1], env, guard)
                if not (isinstance(m, int) and g.is_const(m)):
                    self.err(call, f"the message of {kind}() must be a constant string")
                msg = str(g.value(m))
            if g.is_const(c) and g.value(c):
                return
            if g.is_const(guard) and not g.value(guard):
                return
            self.checks.append(Check(kind, guard, c, msg, ast.unparse(call.args[0]), self.where(s),
                                     id(s) in self._domain_stmts))
        elif isinstance(s, ast.Pass):
            return
        else:
            self.err(s, f"{type(s).__name__} is not SelIR")

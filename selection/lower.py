"""Partial evaluation of a SelIR program for a deployment's facts, and its
lowering to one SSA dependence graph (paper §4).

Facts become constants; constant conditions drop their dead branch; static
``for`` loops unroll; calls inline; module tables become constants. A
conditional merges the variables its branches assign with ``phi`` nodes
(control dependence on the condition); a function's value is the first-match
chain of its return statements over their path conditions, so a selection
point's value is a ``phi`` chain. ``require``/``assume`` become checks
guarded by the condition under which execution reaches them.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from typing import Any

from detent.selection import lang
from detent.selection.ir import ABSENT, Check, Graph

_BIN = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv", ast.FloorDiv: "floordiv",
        ast.Mod: "mod", ast.Pow: "pow"}
_CMP = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge",
        ast.In: "in", ast.NotIn: "notin", ast.Is: "is", ast.IsNot: "isnot"}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_TYPES = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,)}


@dataclass(frozen=True)
class TupleV:
    items: tuple


@dataclass(frozen=True)
class RecordV:
    items: dict


@dataclass(frozen=True)
class FuncRef:
    name: str


class _Bind(ast.stmt):
    """Synthetic statement: bind a loop target to one element of a static collection."""
    _fields = ()

    def __init__(self, target: ast.expr, value: Any, lineno: int):
        super().__init__()
        self.target, self.value, self.lineno, self.col_offset = target, value, lineno, 0


@dataclass
class Lowered:
    graph: Graph
    outputs: dict[str, int]  # selection point -> node
    checks: list[Check]
    inputs: dict[str, int]  # runtime/unpinnable input name -> node
    kinds: dict[str, str]  # input name -> runtime | unpinnable
    domains: dict[str, tuple]  # input name -> (lo, hi) or ("in", values)
    knobs: dict[str, tuple]  # knob name -> (choices, default)
    facts_used: dict[str, Any] = field(default_factory=dict)


class Lowerer:
    def __init__(self, prog: lang.Program, facts: dict[str, Any], level: str = "full"):
        self.p, self.facts = prog, facts
        self.g = Graph(level)
        self.checks: list[Check] = []
        self.knobs: dict[str, tuple] = {}
        self.call_stack: list[str] = []
        self._consts: dict[str, Any] = {}
        self._domain_stmts: set[int] = set()

    # ---- errors
    def err(self, node: ast.AST, msg: str):
        raise lang.SelIRSyntaxError(msg, self.p.filename, getattr(node, "lineno", 0), getattr(node, "col_offset", 0))

    def where(self, node: ast.AST) -> str:
        return f"{self.p.filename}:{getattr(node, 'lineno', 0)}"

    # ---- entry points
    def lower(self, fn: ast.FunctionDef | None = None) -> Lowered:
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 20000))
        try:
            return self._lower(fn or self.p.entry)
        finally:
            sys.setrecursionlimit(old)

    def _lower(self, fn: ast.FunctionDef) -> Lowered:
        g = self.g
        env: dict[str, Any] = {}
        inputs, kinds, used = {}, {}, {}
        params = [lang._param(a, self.p.filename) for a in fn.args.args]
        for prm in params:
            if prm.kind == "fact":
                if prm.name not in self.facts:
                    raise lang.SelIRError(f"program {self.p.name!r} ({self.p.filename}:{prm.lineno}) needs fact "
                                          f"{prm.name!r}, which the deployment facts do not give")
                v = self.facts[prm.name]
                ok = _TYPES.get(prm.type)
                if ok and not (isinstance(v, ok) and not (prm.type != "bool" and isinstance(v, bool)
                                                          and prm.type != "int")):
                    raise lang.SelIRError(f"fact {prm.name!r} should be {prm.type} for program {self.p.name!r}, "
                                          f"got {v!r} ({type(v).__name__})")
                env[prm.name] = g.const(v)
                used[prm.name] = v
        domains = self._domains(fn, params, env)
        for prm in params:
            if prm.kind != "fact":
                d = domains[prm.name]
                lo, hi = (d[0], d[1]) if d[0] != "in" else (None, None)
                env[prm.name] = inputs[prm.name] = g.input(prm.name, prm.kind, lo, hi)
                kinds[prm.name] = prm.kind
        g.cur_line = fn.lineno
        out = self.function(fn, env, g.const(True))
        if isinstance(out, int) and g.is_const(out) and isinstance(g.value(out), dict):
            out = RecordV({k: g.const(v) for k, v in g.value(out).items()})
        if not isinstance(out, RecordV) or not all(isinstance(k, str) for k in out.items):
            self.err(fn, f"function {fn.name!r} must return a dict {{selection_point: value}}")
        outputs = {k: self.node(v, fn) for k, v in out.items.items()}
        return Lowered(g, outputs, self.checks, inputs, kinds, domains, dict(self.knobs), used)

    def _domains(self, fn: ast.FunctionDef, params: list[lang.Param], env: dict) -> dict[str, tuple]:
        """Bounds of each runtime input: Runtime[T, lo, hi] or top-level assume(lo <= x <= hi)."""
        rt = {p.name: p for p in params if p.kind != "fact"}
        lo: dict[str, Any] = {}
        hi: dict[str, Any] = {}
        cats: dict[str, tuple] = {}

        def const_of(e: ast.expr):
            try:
                v = self.expr(e, dict(env), self.g.const(True))
            except lang.SelIRSyntaxError:
                return None
            return self.g.value(v) if isinstance(v, int) and self.g.is_const(v) else None

        for p in rt.values():
            if p.bounds is not None:
                lo[p.name], hi[p.name] = const_of(p.bounds[0]), const_of(p.bounds[1])
                if lo[p.name] is None or hi[p.name] is None:
                    raise lang.SelIRError(f"{self.p.filename}:{p.lineno}: bounds of {p.name!r} must be constant "
                                          "for these facts")
        for s in fn.body:
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)
                    and s.value.func.id == "assume" and s.value.args):
                continue
            c = s.value.args[0]
            conj = c.values if isinstance(c, ast.BoolOp) and isinstance(c.op, ast.And) else [c]
            found = False
            for part in conj:
                if not isinstance(part, ast.Compare):
                    continue
                terms = [part.left] + list(part.comparators)
                for (a, op, b) in zip(terms, part.ops, terms[1:]):
                    if isinstance(op, ast.In) and isinstance(a, ast.Name) and a.id in rt:
                        vals = const_of(b)
                        if isinstance(vals, (tuple, list)):
                            cats[a.id] = tuple(vals)
                            found = True
                        continue
                    name = _CMP.get(type(op))
                    if name not in ("lt", "le", "gt", "ge"):
                        continue
                    if isinstance(b, ast.Name) and b.id in rt and not (isinstance(a, ast.Name) and a.id in rt):
                        a, b, name = b, a, _FLIP[name]
                    if not (isinstance(a, ast.Name) and a.id in rt):
                        continue
                    v = const_of(b)
                    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
                        continue
                    integral = rt[a.id].type in ("int", "bool")
                    if name in ("ge", "gt"):
                        v = v + 1 if (name == "gt" and integral) else v
                        lo[a.id] = v if a.id not in lo else max(lo[a.id], v)
                    else:
                        v = v - 1 if (name == "lt" and integral) else v
                        hi[a.id] = v if a.id not in hi else min(hi[a.id], v)
                    found = True
            if found:
                self._domain_stmts.add(id(s))
        doms: dict[str, tuple] = {}
        for name, p in rt.items():
            if name in cats:
                doms[name] = ("in", cats[name])
            elif p.type == "bool":
                doms[name] = ("in", (False, True))
            elif name in lo and name in hi:
                if lo[name] > hi[name]:
                    raise lang.SelIRError(f"runtime input {name!r} of program {self.p.name!r} has an empty domain "
                                          f"[{lo[name]}, {hi[name]}] for these facts")
                doms[name] = (lo[name], hi[name])
            else:
                raise lang.SelIRError(
                    f"{self.p.filename}:{p.lineno}: runtime input {name!r} of program {self.p.name!r} has no declared "
                    f"bounds: add assume(lo <= {name} <= hi, ...) at the top of {fn.name}() or annotate it "
                    f"{p.kind.capitalize()}[{p.type}, lo, hi]")
        return doms

    # ---- values
    def node(self, v: Any, at: ast.AST) -> int:
        if isinstance(v, int):
            return v
        if isinstance(v, TupleV):
            return self.g.op("tuple", *(self.node(x, at) for x in v.items))
        self.err(at, f"a {type(v).__name__} cannot be used as a scalar value here")

    def as_record(self, v: Any) -> Any:
        g = self.g
        if isinstance(v, int) and g.is_const(v) and isinstance(g.value(v), dict):
            return RecordV({k: g.const(x) for k, x in g.value(v).items()})
        return v

    def merge(self, c: int, a: Any, b: Any, at: ast.AST) -> Any:
        if isinstance(a, RecordV) or isinstance(b, RecordV):
            a, b = self.as_record(a), self.as_record(b)
        if isinstance(a, int) and isinstance(b, int):
            return self.g.phi(c, a, b)
        if isinstance(a, TupleV) and isinstance(b, TupleV) and len(a.items) == len(b.items):
            return TupleV(tuple(self.merge(c, x, y, at) for x, y in zip(a.items, b.items)))
        if isinstance(a, RecordV) and isinstance(b, RecordV):
            keys = list(a.items) + [k for k in b.items if k not in a.items]
            absent = self.g.const(ABSENT)
            return RecordV({k: self.merge(c, a.items.get(k, absent), b.items.get(k, absent), at) for k in keys})
        if isinstance(a, TupleV) and isinstance(b, int) or isinstance(a, int) and isinstance(b, TupleV):
            return self.g.phi(c, self.node(a, at), self.node(b, at))
        self.err(at, f"branches give different kinds of value ({type(a).__name__} vs {type(b).__name__})")

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
                for k in set(ea) | set(eb):
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

    # ---- expressions
    def lookup(self, e: ast.Name, env: dict) -> Any:
        name = e.id
        if name in env:
            return env[name]
        if name in self.p.constants:
            if name not in self._consts:
                if name in self.call_stack:
                    self.err(e, f"constant {name!r} refers to itself")
                self.call_stack.append(name)
                v = self.expr(self.p.constants[name], {}, self.g.const(True))
                self.call_stack.pop()
                self._consts[name] = v
            return self._consts[name]
        if name in self.p.functions:
            return FuncRef(name)
        if name in ("True", "False", "None"):
            return self.g.const({"True": True, "False": False, "None": None}[name])
        if name == "ABSENT":
            return self.g.const(ABSENT)
        self.err(e, f"name {name!r} is not defined (or not defined on every path)")

    def cond(self, e: ast.expr, env: dict, guard: int) -> int:
        return self.node(self.expr(e, env, guard), e)

    def expr(self, e: ast.expr, env: dict, guard: int) -> Any:
        g = self.g
        if isinstance(e, ast.Constant):
            return g.const(e.value)
        if isinstance(e, ast.Name):
            return self.lookup(e, env)
        if isinstance(e, ast.BinOp):
            a, b = self.expr(e.left, env, guard), self.expr(e.right, env, guard)
            if isinstance(a, TupleV) and isinstance(b, TupleV) and isinstance(e.op, ast.Add):
                return TupleV(a.items + b.items)
            return g.op(_BIN[type(e.op)], self.node(a, e), self.node(b, e))
        if isinstance(e, ast.UnaryOp):
            a = self.node(self.expr(e.operand, env, guard), e)
            return {ast.USub: lambda: g.op("neg", a), ast.UAdd: lambda: g.op("pos", a),
                    ast.Not: lambda: g.lnot(a)}[type(e.op)]()
        if isinstance(e, ast.BoolOp):
            v = self.node(self.expr(e.values[0], env, guard), e)
            for x in e.values[1:]:
                if isinstance(e.op, ast.And):
                    w = self.node(self.expr(x, env, g.land(guard, v)), e)
                    v = g.phi(v, w, v)
                else:
                    w = self.node(self.expr(x, env, g.land(guard, g.lnot(v))), e)
                    v = g.phi(v, v, w)
            return v
        if isinstance(e, ast.Compare):
            left = self.node(self.expr(e.left, env, guard), e)
            res = None
            for op, comp in zip(e.ops, e.comparators):
                rv = self.expr(comp, env, guard)
                name = _CMP[type(op)]
                if name in ("in", "notin") and isinstance(rv, TupleV):
                    acc = g.const(False)
                    for item in rv.items:
                        eq = g.op("eq", left, self.node(item, e))
                        acc = g.phi(acc, acc, eq)
                    c = acc if name == "in" else g.lnot(acc)
                    right = None
                else:
                    right = self.node(rv, e)
                    c = g.op(name, left, right)
                res = c if res is None else g.phi(res, c, res)
                if right is None:
                    right = self.node(rv, e)
                left = right
            return res
        if isinstance(e, ast.IfExp):
            c = self.cond(e.test, env, guard)
            if g.is_const(c):
                return self.expr(e.body if g.value(c) else e.orelse, env, guard)
            a = self.expr(e.body, env, g.land(guard, c))
            b = self.expr(e.orelse, env, g.land(guard, g.lnot(c)))
            return self.merge(c, a, b, e)
        if isinstance(e, ast.Call):
            return self.call(e, env, guard)
        if isinstance(e, ast.Subscript):
            base = self.expr(e.value, env, guard)
            key = self.node(self.expr(e.slice, env, guard), e)
            if isinstance(base, TupleV):
                if g.is_const(key):
                    try:
                        return base.items[g.value(key)]
                    except (IndexError, TypeError):
                        self.err(e, f"index {g.value(key)!r} out of range for a tuple of {len(base.items)}")
                base = self.node(base, e)
            if isinstance(base, RecordV):
                if g.is_const(key) and g.value(key) in base.items:
                    return base.items[g.value(key)]
                self.err(e, "a dict value can only be indexed with one of its constant keys")
            return g.op("index", self.node(base, e), key)
        if isinstance(e, (ast.Tuple, ast.List)):
            items = tuple(self.expr(x, env, guard) for x in e.elts)
            if all(isinstance(x, int) and g.is_const(x) for x in items):
                return g.const(tuple(g.value(x) for x in items))
            return TupleV(items)
        if isinstance(e, ast.Dict):
            keys = [self.node(self.expr(k, env, guard), e) for k in e.keys]
            vals = [self.expr(v, env, guard) for v in e.values]
            if not all(g.is_const(k) for k in keys):
                self.err(e, "dict keys must be constants")
            if all(isinstance(v, int) and g.is_const(v) for v in vals):
                return g.const({g.value(k): g.value(v) for k, v in zip(keys, vals)})
            return RecordV({g.value(k): v for k, v in zip(keys, vals)})
        self.err(e, f"{type(e).__name__} is not SelIR")

    def call(self, e: ast.Call, env: dict, guard: int) -> Any:
        g = self.g
        name = e.func.id
        if name == "knob":
            return self.knob(e, env, guard)
        if name in lang.BUILTINS and name not in self.p.functions:
            if e.keywords:
                self.err(e, f"{name}() takes no keyword arguments in SelIR")
            args = [self.expr(a, env, guard) for a in e.args]
            if name in ("min", "max") and len(args) == 1 and isinstance(args[0], TupleV):
                args = list(args[0].items)
            if name == "len" and isinstance(args[0], TupleV):
                return g.const(len(args[0].items))
            return g.op(name, *(self.node(a, e) for a in args))
        fn = self.p.functions.get(name)
        if fn is None:
            self.err(e, f"call of unknown function {name!r}")
        if name in self.call_stack:
            self.err(e, f"recursive call of {name!r} is not SelIR")
        params = [a.arg for a in fn.args.args]
        defaults = fn.args.defaults
        bound: dict[str, Any] = {}
        if len(e.args) > len(params):
            self.err(e, f"{name}() takes {len(params)} arguments, {len(e.args)} given")
        for p, a in zip(params, e.args):
            bound[p] = self.expr(a, env, guard)
        for k in e.keywords:
            if k.arg not in params or k.arg in bound:
                self.err(e, f"{name}() got an unexpected or repeated argument {k.arg!r}")
            bound[k.arg] = self.expr(k.value, env, guard)
        for p, d in zip(params[len(params) - len(defaults):], defaults):
            if p not in bound:
                bound[p] = self.expr(d, {}, guard)
        missing = [p for p in params if p not in bound]
        if missing:
            self.err(e, f"{name}() missing argument(s) {missing}")
        self.call_stack.append(name)
        line = g.cur_line
        res = self.function(fn, bound, guard)
        g.cur_line = line
        self.call_stack.pop()
        if isinstance(res, int) and g.ops[res] not in ("const", "input"):
            g.label(res, name)  # a helper's result is named after the helper (e.g. a pin `tile_size`)
        return res

    def knob(self, e: ast.Call, env: dict, guard: int) -> int:
        g = self.g
        args = list(e.args) + [k.value for k in e.keywords]
        if len(args) != 3:
            self.err(e, "knob(name, choices, default) takes three arguments")
        vals = [self.expr(a, env, guard) for a in args]
        if not all(isinstance(v, int) and g.is_const(v) for v in vals):
            self.err(e, "knob name, choices and default must be constant for these facts")
        name, choices, default = (g.value(v) for v in vals)
        if not isinstance(name, str) or not isinstance(choices, tuple) or not choices:
            self.err(e, "knob(name: str, choices: non-empty tuple, default)")
        if default not in choices:
            self.err(e, f"knob {name!r}: default {default!r} is not one of its choices {choices}")
        if name in self.knobs and self.knobs[name] != (choices, default):
            self.err(e, f"knob {name!r} declared twice with different choices/default")
        self.knobs[name] = (choices, default)
        return g.knob(name, choices, default)


def lower(prog: lang.Program, facts: dict[str, Any], level: str = "full") -> Lowered:
    return Lowerer(prog, facts, level).lower()


def lower_conservative(prog: lang.Program, facts: dict[str, Any]) -> dict:
    """Evaluate the program's `conservative()` (facts only) to its constant selection."""
    if prog.conservative is None:
        raise lang.SelIRError(f"program {prog.name!r} ({prog.filename}) has no conservative() function, which "
                              "mode 'conservative' needs")
    lw = Lowerer(prog, facts, "full").lower(prog.conservative)
    g = lw.graph
    out = {}
    for k, n in lw.outputs.items():
        if not g.is_const(n):
            raise lang.SelIRError(f"conservative() of {prog.name!r}: selection point {k!r} is not constant")
        if g.value(n) is not ABSENT:
            out[k] = g.value(n)
    return out

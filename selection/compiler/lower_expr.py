"""Expression lowering for SelIR (split from lower.py): the structured values
(tuples, records, function references) a partial evaluation carries, their
merge under a condition into ``phi`` nodes, and the lowering of expressions,
calls (inlined) and ``knob()`` declarations to SSA nodes. Mixed into
:class:`detent.selection.compiler.lower.Lowerer`, which provides ``self.g``, ``self.p``,
``self.err`` and the statement lowering.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from detent.selection.compiler import lang
from detent.selection.compiler.ir import ABSENT


_BIN = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv", ast.FloorDiv: "floordiv",
        ast.Mod: "mod", ast.Pow: "pow"}
_CMP = {ast.Eq: "eq", ast.NotEq: "ne", ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge",
        ast.In: "in", ast.NotIn: "notin", ast.Is: "is", ast.IsNot: "isnot"}


@dataclass(frozen=True)
class TupleV:
    items: tuple


@dataclass(frozen=True)
class RecordV:
    items: dict


@dataclass(frozen=True)
class FuncRef:
    name: str


class ExprLowering:
    """Values and expressions of :class:`~detent.selection.compiler.lower.Lowerer`."""

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

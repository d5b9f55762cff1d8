"""Partial evaluation of a SelIR program for a deployment's facts, and its
lowering to one SSA dependence graph (docs/selir.md section 2).

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

from detent.selection.compiler import lang
from detent.selection.compiler.ir import ABSENT, Check, Graph
from detent.selection.compiler.lower_expr import _BIN, _CMP, ExprLowering, FuncRef, RecordV, TupleV  # noqa: F401
from detent.selection.compiler.lower_stmt import StmtLowering, _Bind  # noqa: F401

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_TYPES = {"int": (int,), "float": (float, int), "bool": (bool,), "str": (str,)}


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


class Lowerer(StmtLowering, ExprLowering):
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

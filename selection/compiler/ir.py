"""The SSA dependence graph a SelIR program lowers to (docs/selir.md section 2).

Every value is one node: a constant, an input, a knob, or an operation on
other nodes. Nodes are hash-consed (one node per distinct computation), and
the builder simplifies as it goes:

* level ``"fold"``: constant folding and dead-branch elimination only
  (a ``phi`` whose condition is constant, or whose arms are equal);
* level ``"full"``: also interval (value-range) folding from the runtime
  inputs' declared domains, and algebraic identities.

``phi(c, a, b)`` is the merge of a conditional (``a if c else b``); its
condition edge is a *control* dependence, its arms data dependences. It is
lazy: only the taken arm is evaluated.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

from detent.selection.compiler import lang

ABSENT = lang.ABSENT


def _in(a, b):
    return a in b


def _notin(a, b):
    return a not in b


def _index(c, k):
    return c[k]


def _tuple(*xs):
    return tuple(xs)


def _min(*xs):
    return min(xs) if len(xs) > 1 else min(xs[0])


def _max(*xs):
    return max(xs) if len(xs) > 1 else max(xs[0])


# op name -> (python function, infix symbol for code generation or None)
OPS: dict[str, tuple[Callable, str | None]] = {
    "add": (operator.add, "+"), "sub": (operator.sub, "-"), "mul": (operator.mul, "*"),
    "truediv": (operator.truediv, "/"), "floordiv": (operator.floordiv, "//"), "mod": (operator.mod, "%"),
    "pow": (operator.pow, "**"),
    "eq": (operator.eq, "=="), "ne": (operator.ne, "!="), "lt": (operator.lt, "<"), "le": (operator.le, "<="),
    "gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "in": (_in, "in"), "notin": (_notin, "not in"),
    "is": (operator.is_, "is"), "isnot": (operator.is_not, "is not"),
    "neg": (operator.neg, None), "pos": (operator.pos, None), "not": (operator.not_, None),
    "min": (_min, None), "max": (_max, None), "abs": (abs, None), "cdiv": (lang.cdiv, None),
    "log2": (lang.log2, None), "next_pow2": (lang.next_pow2, None), "round_up": (lang.round_up, None),
    "int": (int, None), "float": (float, None), "bool": (bool, None), "len": (len, None),
    "index": (_index, None), "tuple": (_tuple, None), "copy": (lambda x: x, None),
    "neutral": (lang.neutral, None),
}
COMPARES = ("eq", "ne", "lt", "le", "gt", "ge", "in", "notin", "is", "isnot")
LEAVES = ("const", "input", "knob", "param")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))


def _hull(*rs):
    if any(r is None for r in rs):
        return None
    return (min(r[0] for r in rs), max(r[1] for r in rs))


def _corners(f, a, b):
    try:
        vs = [f(x, y) for x in a for y in b]
    except (ZeroDivisionError, OverflowError, ValueError):
        return None
    if not all(_num(v) for v in vs):
        return None
    return (min(vs), max(vs))


class Graph:
    """An append-only, hash-consed SSA graph with on-the-fly simplification."""

    def __init__(self, level: str = "full"):
        if level not in ("fold", "full"):
            raise ValueError(f"simplification level must be 'fold' or 'full', got {level!r}")
        self.level = level
        self.ops: list[str] = []
        self.args: list[tuple[int, ...]] = []
        self.vals: list[Any] = []  # const value / input name / knob (name, choices, default)
        self.rng: list[tuple | None] = []  # value interval (always tracked; used to simplify at level "full")
        self.names: list[list[str]] = []  # source names bound to the node
        self.line: list[int] = []
        self._memo: dict[tuple, int] = {}
        self.ranges_on = level == "full"
        self.cur_line = 0

    def __len__(self) -> int:
        return len(self.ops)

    # ---- construction
    def _add(self, op: str, args: tuple[int, ...], val: Any, key: tuple, rng=None) -> int:
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        i = len(self.ops)
        self.ops.append(op)
        self.args.append(args)
        self.vals.append(val)
        self.rng.append(rng)
        self.names.append([])
        self.line.append(self.cur_line)
        self._memo[key] = i
        return i

    def const(self, v: Any) -> int:
        r = (v, v) if _num(v) else None
        return self._add("const", (), v, ("const", type(v).__name__, repr(v)), r)

    def input(self, name: str, kind: str, lo=None, hi=None) -> int:
        r = (lo, hi) if (lo is not None and hi is not None) else None
        return self._add("input", (), (name, kind), ("input", name), r)

    def knob(self, name: str, choices: tuple, default: Any) -> int:
        nums = [c for c in choices if _num(c)]
        r = (min(nums), max(nums)) if len(nums) == len(choices) else None
        return self._add("knob", (), (name, tuple(choices), default), ("knob", name), r)

    def param(self, name: str) -> int:
        return self._add("param", (), name, ("param", name))

    def copy(self, i: int, tag: str) -> int:
        """A distinct node with i's value (a selection point that is an input itself
        gets one, so the cut can pin the point without cutting the input)."""
        return self._add("copy", (i,), None, ("copy", i, tag), self.rng[i])

    def is_const(self, i: int) -> bool:
        return self.ops[i] == "const"

    def value(self, i: int) -> Any:
        return self.vals[i]

    def label(self, i: int, name: str) -> None:
        if name not in self.names[i]:
            self.names[i].append(name)

    def op(self, name: str, *args: int) -> int:
        if name == "phi":
            return self.phi(*args)
        fn = OPS[name][0]
        if all(self.ops[a] == "const" for a in args):
            try:
                return self.const(fn(*(self.vals[a] for a in args)))
            except Exception:
                pass  # raises when (and only if) evaluated at run time
        if self.level == "full":
            s = self._simplify(name, args)
            if s is not None:
                return s
            # an operation on a phi of constants is a phi of constants
            # (not for a phi used as a table key: the cut should be able to fall on the key)
            phis = [j for j, a in enumerate(args) if self.ops[a] == "phi" and not (name == "index" and j == 1)]
            if len(phis) == 1 and name not in ("tuple", "neutral") and all(self.ops[a] == "const" for j, a in enumerate(args)
                                                          if j != phis[0]):
                j = phis[0]
                c, ta, fa = self.args[args[j]]
                if self.ops[ta] == "const" and self.ops[fa] == "const":
                    at = args[:j] + (ta,) + args[j + 1:]
                    af = args[:j] + (fa,) + args[j + 1:]
                    x, y = self.op(name, *at), self.op(name, *af)
                    if self.ops[x] == "const" and self.ops[y] == "const":
                        return self.phi(c, x, y)
        return self._add(name, args, None, (name, args), self._range(name, args))

    def phi(self, c: int, a: int, b: int) -> int:
        if self.ops[c] == "const":
            return a if self.vals[c] else b
        if a == b and self.level == "full":
            return a
        if self.level == "full" and self.ops[c] == "not":
            c, a, b = self.args[c][0], b, a
        r = _hull(self.rng[a], self.rng[b])
        return self._add("phi", (c, a, b), None, ("phi", (c, a, b)), r)

    def land(self, g: int, c: int) -> int:
        """`g and c` as a path guard."""
        return self.phi(g, c, g)

    def lnot(self, c: int) -> int:
        if self.ops[c] == "not" and self.level == "full":
            return self.op("bool", self.args[c][0])
        return self.op("not", c)

    # ---- simplification (level "full")
    def _simplify(self, name: str, args: tuple[int, ...]) -> int | None:
        rng = (lambda i: self.rng[i]) if self.ranges_on else (lambda i: None)
        cv = lambda i: self.vals[i] if self.ops[i] == "const" else None  # noqa: E731
        if name in ("lt", "le", "gt", "ge", "eq", "ne") and len(args) == 2:
            a, b = rng(args[0]), rng(args[1])
            if args[0] == args[1] and self.ops[args[0]] in ("input", "knob", "param") or (
                    args[0] == args[1] and a is not None):
                return self.const(name in ("le", "ge", "eq"))
            if a is not None and b is not None:
                if name == "lt":
                    return self.const(True) if a[1] < b[0] else self.const(False) if a[0] >= b[1] else None
                if name == "le":
                    return self.const(True) if a[1] <= b[0] else self.const(False) if a[0] > b[1] else None
                if name == "gt":
                    return self.const(True) if a[0] > b[1] else self.const(False) if a[1] <= b[0] else None
                if name == "ge":
                    return self.const(True) if a[0] >= b[1] else self.const(False) if a[1] < b[0] else None
                if a[1] < b[0] or b[1] < a[0]:
                    return self.const(name == "ne")
            return None
        if name in ("min", "max") and len(args) >= 2:
            rs = [rng(a) for a in args]
            if all(r is not None for r in rs):
                keep = []
                for i, a in enumerate(args):
                    dominated = any(
                        (rs[j][1] <= rs[i][0] if name == "min" else rs[j][0] >= rs[i][1]) and
                        (rs[j] != rs[i] or j < i) for j in range(len(args)) if j != i)
                    if not dominated:
                        keep.append(a)
                if len(keep) == 1:
                    return keep[0]
                if len(keep) < len(args):
                    return self.op(name, *keep)
            return None
        if name == "abs":
            r = rng(args[0])
            if r is not None and r[0] >= 0:
                return args[0]
            return None
        if len(args) == 2:
            x, y = args
            if name == "add" and cv(y) == 0 and type(cv(y)) is int:
                return x
            if name == "add" and cv(x) == 0 and type(cv(x)) is int:
                return y
            if name in ("mul",) and cv(y) == 1 and type(cv(y)) is int:
                return x
            if name in ("mul",) and cv(x) == 1 and type(cv(x)) is int:
                return y
            if name in ("floordiv", "cdiv") and cv(y) == 1 and type(cv(y)) is int:
                r = rng(x)
                if r is not None and all(isinstance(v, int) for v in r):
                    return x
            if name == "round_up" and cv(y) == 1 and type(cv(y)) is int:
                r = rng(x)
                if r is not None and all(isinstance(v, int) for v in r):
                    return x
        if name == "bool" and self.ops[args[0]] in COMPARES + ("not",):
            return args[0]
        return None

    def _range(self, name: str, args: tuple[int, ...]):
        rs = [self.rng[a] for a in args]
        if name in COMPARES or name in ("not", "bool"):
            return (0, 1)
        if name == "index":
            c = args[0]
            if self.ops[c] == "phi":
                arms = self.args[c][1:]
                if all(self.ops[a] == "const" for a in arms):
                    return _hull(*(self._index_range(self.vals[a], rs[1]) for a in arms))
                return None
            if self.ops[c] != "const":
                return None
            return self._index_range(self.vals[c], rs[1])
        if any(r is None for r in rs):
            return None
        try:
            if name in ("add", "sub", "mul", "truediv", "floordiv", "cdiv", "round_up"):
                a, b = rs
                if name in ("truediv", "floordiv", "cdiv", "round_up") and not (b[0] > 0):
                    return None
                f = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
                     "floordiv": operator.floordiv, "cdiv": lang.cdiv, "round_up": lang.round_up}[name]
                return _corners(f, a, b)
            if name == "mod":
                a, b = rs
                if b[0] == b[1] and b[0] > 0 and a[0] >= 0:
                    return (a[0], a[1]) if a[1] < b[0] and isinstance(b[0], int) and a[0] == a[1] else (0, b[0] - 1) \
                        if isinstance(b[0], int) else (0, b[0])
                return None
            if name == "neg":
                return (-rs[0][1], -rs[0][0])
            if name == "pos":
                return rs[0]
            if name in ("min", "max") and len(rs) >= 2:
                f = min if name == "min" else max
                return (f(r[0] for r in rs), f(r[1] for r in rs))
            if name == "abs":
                lo, hi = rs[0]
                return (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0, max(-lo, hi))
            if name == "log2" and rs[0][0] > 0:
                return (lang.log2(rs[0][0]), lang.log2(rs[0][1]))
            if name == "next_pow2":
                return (lang.next_pow2(rs[0][0]), lang.next_pow2(rs[0][1]))
            if name in ("int", "float"):
                f = int if name == "int" else float
                if all(math.isfinite(v) for v in rs[0]):
                    return (f(rs[0][0]), f(rs[0][1]))
        except (TypeError, ValueError, OverflowError):
            return None
        return None


    @staticmethod
    def _index_range(table, kr):
        try:
            if isinstance(table, dict):
                vals = [v for k, v in table.items() if kr is None or (_num(k) and kr[0] <= k <= kr[1])]
            elif isinstance(table, (tuple, list)):
                lo, hi = (0, len(table) - 1) if kr is None else (max(0, int(kr[0])), min(len(table) - 1, int(kr[1])))
                vals = list(table[lo:hi + 1])
            else:
                return None
        except (TypeError, ValueError):
            return None
        if vals and all(_num(v) for v in vals):
            return (min(vals), max(vals))
        return None

    # ---- queries
    def reachable(self, roots: list[int], stop: set[int] = frozenset()) -> list[int]:
        """Nodes reachable from roots (through args), in topological order."""
        seen: set[int] = set()
        order: list[int] = []
        stack = [(r, False) for r in reversed(roots)]
        while stack:
            n, done = stack.pop()
            if done:
                order.append(n)
                continue
            if n in seen:
                continue
            seen.add(n)
            stack.append((n, True))
            if n not in stop:
                for a in reversed(self.args[n]):
                    if a not in seen:
                        stack.append((a, False))
        return order

    def describe(self, i: int) -> str:
        op = self.ops[i]
        if op == "const":
            r = repr(self.vals[i])
            return r if len(r) < 40 else r[:37] + "..."
        if op in ("input", "param"):
            return str(self.vals[i][0] if op == "input" else self.vals[i])
        if op == "knob":
            return f"knob {self.vals[i][0]}"
        return f"{op}({', '.join('%' + str(a) for a in self.args[i])})"


@dataclass(frozen=True)
class Check:
    kind: str  # "require" | "assume"
    guard: int  # node: the path condition under which the check runs
    cond: int
    msg: str
    text: str  # the condition's source
    where: str  # file:line
    domain: bool = False  # a domain-defining assume on an input (bounds)

"""Python source generation from the SSA graph: compiled selectors (docs/selir.md section 3).

`Emitter` turns the nodes needed by a set of roots into straight-line Python
statements. A ``phi`` becomes an ``if``/``else`` whose arms are computed only
inside their branch (Python's lazy semantics); a chain of ``phi``s in else
position (the shape an unrolled loop with early returns takes) becomes one
flat ``while True: ... break`` block, so generated code never nests deeper
than the source did. Leaves (inputs, pins, knobs) are given as names or
constants, so pinning is only a different leaf map: no re-lowering.
"""
from __future__ import annotations

import math
from typing import Any

from detent.selection.compiler import lang
from detent.selection.compiler.ir import ABSENT, Check, Graph

_INFIX = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
          "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "in": "in", "notin": "not in",
          "is": "is", "isnot": "is not"}
_CALLS = ("min", "max", "abs", "cdiv", "log2", "next_pow2", "round_up", "int", "float", "bool", "len")
_NOT_CONSTANT = object()  # a phi-tree leaf that is not a constant (`_phi_leaves`)


def base_namespace() -> dict[str, Any]:
    ns = dict(lang.BUILTINS)
    ns.update(_ABSENT=ABSENT, SelectionError=lang.SelectionError)
    return ns


class Emitter:
    def __init__(self, g: Graph, leaves: dict[int, str], ns: dict[str, Any], known: dict[int, Any] | None = None):
        """known: leaves with a value fixed at generation time (pins, knobs):
        everything computable from them is folded into the generated code."""
        self.g, self.leaves, self.ns = g, leaves, ns
        self.known = dict(known or {})
        self._static: dict[int, tuple[bool, Any]] = {}
        self._k = 0

    _NO = (False, None)

    def static(self, n: int) -> tuple[bool, Any]:
        """(True, value) when n's value is fixed at generation time."""
        hit = self._static.get(n)
        if hit is not None:
            return hit
        g = self.g
        op = g.ops[n]
        if op == "const":
            r = (True, g.vals[n])
        elif n in self.known:
            r = (True, self.known[n])
        elif n in self.leaves or not self.known or op in ("input", "knob", "param"):
            r = self._NO
        elif op == "phi":
            c = self.static(g.args[n][0])
            r = self.static(g.args[n][1] if c[1] else g.args[n][2]) if c[0] else self._NO
        else:
            vals = [self.static(a) for a in g.args[n]]
            r = self._NO
            if all(v[0] for v in vals):
                from detent.selection.compiler.ir import OPS
                try:
                    r = (True, OPS[op][0](*(v[1] for v in vals)))
                except Exception:
                    r = self._NO
        self._static[n] = r
        return r

    def live(self, roots: list[int]) -> set[int]:
        """Nodes the generated code may evaluate for these roots (untaken arms of
        statically decided phis and static values are not)."""
        g = self.g
        seen: set[int] = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if self.static(n)[0] or n in self.leaves:
                continue
            if g.ops[n] == "phi":
                c = self.static(g.args[n][0])
                stack.extend([g.args[n][1] if c[1] else g.args[n][2]] if c[0] else g.args[n])
            else:
                stack.extend(g.args[n])
        return seen

    _SAFE = {"add", "sub", "mul", "eq", "ne", "lt", "le", "gt", "ge", "is", "isnot", "not", "neg", "pos",
             "abs", "bool", "tuple", "phi", "copy", "neutral"}
    _DIVS = {"truediv", "floordiv", "mod", "cdiv", "round_up"}

    def _phi_leaves(self, n: int):
        """The constants at the leaves of the phi tree rooted at n, each node once;
        yields `_NOT_CONSTANT` (and stops) at a leaf that is not a constant."""
        g = self.g
        stack, seen = [n], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            st = self.static(x)
            if st[0]:
                yield st[1]
            elif g.ops[x] == "phi":
                stack.extend(g.args[x][1:])
            else:
                yield _NOT_CONSTANT
                return

    def _values(self, n: int, limit: int = 256) -> set | None:
        """The finite set of values n can take (phi trees over constants), else None."""
        out: set = set()
        for v in self._phi_leaves(n):
            if v is _NOT_CONSTANT:
                return None
            try:
                out.add(v)
            except TypeError:
                return None
            if len(out) > limit:
                return None
        return out

    def _safe_op(self, n: int) -> bool:
        """Can this operation not raise, whatever branch it sits in?"""
        g = self.g
        op, args = g.ops[n], g.args[n]
        if op in self._SAFE:
            return True
        if op in ("min", "max"):
            return len(args) >= 2
        if op in self._DIVS:
            d = args[1]
            r = g.rng[d]
            if self.static(d)[0]:
                v = self.static(d)[1]
                return isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0
            return r is not None and (r[0] > 0 or r[1] < 0)
        if op in ("log2",):
            r = g.rng[args[0]]
            return r is not None and r[0] > 0 and isinstance(r[0], int)
        if op == "next_pow2":
            return g.rng[args[0]] is not None
        if op in ("in", "notin"):
            st = self.static(args[1])
            return st[0] and isinstance(st[1], (tuple, list, dict, set, frozenset, str)) and not isinstance(st[1], str)
        if op == "index":
            tables = self._tables(args[0])
            if tables is None:
                return False
            keys = self._values(args[1])
            r = g.rng[args[1]]
            try:
                for table in tables:
                    if keys is None:
                        if not (isinstance(table, (tuple, list)) and r is not None and isinstance(r[0], int)
                                and 0 <= r[0] and r[1] < len(table)):
                            return False
                    elif isinstance(table, dict):
                        if not all(k in table for k in keys):
                            return False
                    elif isinstance(table, (tuple, list)):
                        if not all(isinstance(k, int) and -len(table) <= k < len(table) for k in keys):
                            return False
                    else:
                        return False
            except TypeError:
                return False
            return True
        return False

    def _tables(self, n: int) -> list | None:
        """The constant containers n can be (a phi tree over constants), else None."""
        out = []
        for v in self._phi_leaves(n):
            if v is _NOT_CONSTANT or len(out) == 64:
                return None
            out.append(v)
        return out

    def speculate(self, roots: list[int], out: list[str], avail: set[int], ind: str) -> None:
        """Emit, straight-line and up front, every needed value whose computation
        cannot raise (arithmetic, comparisons, divisions by non-zero constants,
        table lookups whose keys are all present, phis of such values). Only the
        rest is computed lazily inside branches, so shared values are computed
        once and generated code stays flat."""
        g = self.g
        live = self.live(roots)
        order = g.reachable(sorted(live))
        safe: dict[int, bool] = {}
        for x in order:
            if x not in live:
                continue
            if self._ready(x, avail):
                safe[x] = True
                continue
            ok = self._safe_op(x) and all(safe.get(a, self._ready(a, avail)) for a in g.args[x])
            safe[x] = ok
            if not ok:
                continue
            if g.ops[x] == "phi":
                c, a, b = g.args[x]
                out.append(f"{ind}v{x} = {self.ref(a)} if {self.ref(c)} else {self.ref(b)}")
                avail.add(x)
            else:
                self.node(x, out, avail, ind)

    def literal(self, v: Any) -> str:
        if v is ABSENT:
            return "_ABSENT"
        if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
            return repr(v)
        name = f"_k{self._k}"
        self._k += 1
        self.ns[name] = v
        return name

    def ref(self, n: int) -> str:
        if n in self.leaves:
            return self.leaves[n]
        if self.g.ops[n] == "const":
            return self.literal(self.g.vals[n])
        st = self.static(n)
        if st[0]:
            return self.literal(st[1])
        return f"v{n}"

    def _ready(self, n: int, avail: set[int]) -> bool:
        return n in avail or n in self.leaves or self.g.ops[n] == "const" or self.static(n)[0]

    def need(self, n: int, out: list[str], avail: set[int], ind: str) -> None:
        """Emit the statements that compute `n` in the current block."""
        g = self.g
        if self._ready(n, avail):
            return
        order: list[int] = []
        seen: set[int] = set()
        stack = [(n, False)]
        while stack:
            x, done = stack.pop()
            if done:
                order.append(x)
                continue
            if x in seen or self._ready(x, avail):
                continue
            seen.add(x)
            stack.append((x, True))
            if g.ops[x] == "phi":
                c = self.static(g.args[x][0])
                deps = ((g.args[x][1] if c[1] else g.args[x][2]),) if c[0] else g.args[x][:1]
            else:
                deps = g.args[x]
            for a in reversed(deps):
                if a not in seen and not self._ready(a, avail):
                    stack.append((a, False))
        for x in order:
            if x not in avail:
                self.node(x, out, avail, ind)

    def node(self, n: int, out: list[str], avail: set[int], ind: str) -> None:
        g = self.g
        op, args = g.ops[n], g.args[n]
        if op == "phi":
            c = self.static(args[0])
            if c[0]:
                arm = args[1] if c[1] else args[2]
                self.need(arm, out, avail, ind)
                out.append(f"{ind}v{n} = {self.ref(arm)}")
                avail.add(n)
            else:
                self.phi(n, out, avail, ind)
            return
        r = [self.ref(a) for a in args]
        if op in _INFIX:
            e = f"({r[0]} {_INFIX[op]} {r[1]})"
        elif op == "neg":
            e = f"(-{r[0]})"
        elif op == "pos":
            e = f"(+{r[0]})"
        elif op == "not":
            e = f"(not {r[0]})"
        elif op == "index":
            e = f"{r[0]}[{r[1]}]"
        elif op in ("copy", "neutral"):
            e = r[0]
        elif op == "tuple":
            e = "(" + "".join(x + ", " for x in r) + ")"
        elif op in _CALLS:
            e = f"{op}({', '.join(r)})"
        else:
            raise ValueError(f"cannot generate code for node {n} ({op}): not a leaf here")
        out.append(f"{ind}v{n} = {e}")
        avail.add(n)

    def _ucone(self, x: int, avail: set[int]) -> set[int]:
        """Nodes evaluated whenever x is (not yet available): phi arms excluded."""
        g = self.g
        seen: set[int] = set()
        stack = [x]
        while stack:
            y = stack.pop()
            if y in seen or self._ready(y, avail):
                continue
            seen.add(y)
            if g.ops[y] == "phi":
                stack.append(g.args[y][0])
            else:
                stack.extend(g.args[y])
        return seen

    def _chain_next(self, x: int, avail: set[int]) -> int | None:
        """The arm of phi x that continues a flat chain (a phi not yet computed), if any."""
        g = self.g
        for arm in (g.args[x][2], g.args[x][1]):
            if g.ops[arm] == "phi" and not self._ready(arm, avail) and not self.static(g.args[arm][0])[0]:
                return arm
        return None

    def phi(self, n: int, out: list[str], avail: set[int], ind: str) -> None:
        """A phi, or a chain of phis in arm position, as one flat block. Values both
        arms evaluate anyway are computed before the branch (no duplication)."""
        g = self.g
        c, a, b = g.args[n]
        self.need(c, out, avail, ind)  # the first condition and what both arms need run unconditionally
        for x in sorted(self._ucone(a, avail) & self._ucone(b, avail)):
            self.need(x, out, avail, ind)
        lines: list[str] = []
        loop = set(avail)
        i2 = ind + "    "
        cur, count = n, 0
        while True:
            c, a, b = g.args[cur]
            if count:
                self.need(c, lines, loop, i2)
                for x in sorted(self._ucone(a, loop) & self._ucone(b, loop)):
                    self.need(x, lines, loop, i2)
            nxt = self._chain_next(cur, loop) if count < 2000 else None
            if nxt is None:
                break
            taken, neg = (a, False) if nxt == b else (b, True)
            lines.append(f"{i2}if {'not ' if neg else ''}{self.ref(c)}:")
            sub = set(loop)
            self.need(taken, lines, sub, i2 + "    ")
            lines.append(f"{i2}    v{n} = {self.ref(taken)}")
            lines.append(f"{i2}    break")
            cur, count = nxt, count + 1
        c, a, b = g.args[cur]
        lines.append(f"{i2}if {self.ref(c)}:")
        sub = set(loop)
        self.need(a, lines, sub, i2 + "    ")
        lines.append(f"{i2}    v{n} = {self.ref(a)}")
        lines.append(f"{i2}else:")
        sub = set(loop)
        self.need(b, lines, sub, i2 + "    ")
        lines.append(f"{i2}    v{n} = {self.ref(b)}")
        if count == 0:
            out.extend(line[4:] for line in lines)
            avail.update(loop)
        else:
            out.append(f"{ind}while True:")
            out.extend(lines)
            out.append(f"{i2}break")
        avail.add(n)

    def checks(self, checks: list[Check], out: list[str], avail: set[int], ind: str, fail: str) -> None:
        """`fail(i)` is the statement run when check i fails."""
        g = self.g
        for i, ck in enumerate(checks):
            gs = self.static(ck.guard)
            if gs[0] and not gs[1]:
                continue
            cs = self.static(ck.cond)
            if cs[0] and cs[1]:
                continue
            self.need(ck.guard, out, avail, ind)
            if gs[0]:
                self.need(ck.cond, out, avail, ind)
                out.append(f"{ind}if not {self.ref(ck.cond)}:")
                out.append(f"{ind}    {fail.format(i=i)}")
            else:
                out.append(f"{ind}if {self.ref(ck.guard)}:")
                sub = set(avail)
                self.need(ck.cond, out, sub, ind + "    ")
                out.append(f"{ind}    if not {self.ref(ck.cond)}:")
                out.append(f"{ind}        {fail.format(i=i)}")

    def record(self, outputs: dict[str, int], out: list[str], avail: set[int], ind: str) -> str:
        """Emit the outputs and return an expression building the selection dict."""
        g = self.g
        fixed, maybe = [], []
        for k, n in outputs.items():
            st = self.static(n)
            if st[0] and st[1] is ABSENT:
                continue
            self.need(n, out, avail, ind)
            (maybe if self._may_be_absent(n) else fixed).append((k, self.ref(n)))
        d = "{" + ", ".join(f"{k!r}: {v}" for k, v in fixed) + "}"
        if not maybe:
            return d
        out.append(f"{ind}_r = {d}")
        for k, v in maybe:
            out.append(f"{ind}if {v} is not _ABSENT:")
            out.append(f"{ind}    _r[{k!r}] = {v}")
        return "_r"

    def _may_be_absent(self, n: int) -> bool:
        g = self.g
        if self.static(n)[0]:
            return False
        stack, seen = [n], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if g.ops[x] == "const" and g.vals[x] is ABSENT:
                return True
            if g.ops[x] == "phi":
                stack.extend(g.args[x][1:])
            elif g.ops[x] == "index" and g.ops[g.args[x][0]] == "const":
                t = g.vals[g.args[x][0]]
                vs = t.values() if isinstance(t, dict) else t if isinstance(t, (tuple, list)) else ()
                if any(v is ABSENT for v in vs):
                    return True
        return False


def compile_source(src: str, ns: dict[str, Any], filename: str) -> dict[str, Any]:
    code = compile(src, filename, "exec")
    exec(code, ns)
    return ns

"""Pin value range analysis: a pin's legal values (docs/selir.md section 2).

A pin's candidates are the values it takes over the runtime inputs' domains
(under every knob choice), plus the values it takes on the default profile.
An assignment (a value per pin and a setting per knob) is legal when every
require/assume of the pinned program holds at every domain point tried: all
points when the domain is small, a fixed seeded sample otherwise. A point is
in the domain when the unpinned program's assumes hold there.
"""
from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any, Callable

from detent.selection.compiler import lang
from detent.selection.compiler.codegen import Emitter, base_namespace, compile_source
from detent.selection.compiler.lower import Lowered

NOT_REACHED = object()
EXHAUSTIVE_LIMIT = 4096
SAMPLE_POINTS = 512
MAX_ASSIGNMENTS = 200_000


def sort_key(v: Any):
    return (type(v).__name__, v if isinstance(v, (int, float, str, bool)) else repr(v))


class VRA:
    def __init__(self, lw: Lowered, pins: dict[str, int], program: str, seed: int = 0):
        self.lw, self.pins, self.program, self.seed = lw, pins, program, seed
        self.inputs = list(lw.inputs)
        self.knob_names = list(lw.knobs)
        self._probe = self._make_probe()
        self._points: list[tuple] | None = None
        self._checkers: dict[str, Callable] = {}

    # ---- generated helpers
    def _leaves(self, with_pins: bool) -> dict[int, str]:
        g = self.lw.graph
        leaves = {n: name for name, n in self.lw.inputs.items()}
        for name in self.knob_names:
            leaves[g._memo[("knob", name)]] = f"k_{name}"
        if with_pins:
            for j, n in enumerate(self.pins.values()):
                leaves[n] = f"p{j}"
        return leaves

    def _make_probe(self) -> Callable:
        g = self.lw.graph
        ns = base_namespace()
        ns["_NR"] = NOT_REACHED
        em = Emitter(g, self._leaves(False), ns)
        out: list[str] = []
        avail: set[int] = set()
        assumes = [c for c in self.lw.checks if c.kind == "assume"]
        em.speculate([c.guard for c in assumes] + [c.cond for c in assumes] + list(self.pins.values()),
                     out, avail, "    ")
        em.checks(assumes, out, avail, "    ", "return None")
        refs = []
        for j, n in enumerate(self.pins.values()):
            out.append("    try:")
            sub = set(avail)
            em.need(n, out, sub, "        ")
            out.append(f"        p{j} = {em.ref(n)}")
            out.append("    except Exception:")
            out.append(f"        p{j} = _NR")
            refs.append(f"p{j}")
        args = ", ".join(self.inputs + [f"k_{k}" for k in self.knob_names])
        src = f"def _probe({args}):\n" + "\n".join(out) + f"\n    return ({''.join(r + ', ' for r in refs)})\n"
        return compile_source(src, ns, f"<selir probe {self.program}>")["_probe"]

    def _checker(self, which: str) -> Callable:
        """which: 'pins' (checks reading pins/knobs but no input), 'both', 'inputs' (no pins/knobs)."""
        if which in self._checkers:
            return self._checkers[which]
        g = self.lw.graph
        leaves = self._leaves(True)
        stop = set(leaves)
        input_nodes = set(self.lw.inputs.values())
        pinlike = set(leaves) - input_nodes
        sel = []
        for i, ck in enumerate(self.lw.checks):
            reach = set(g.reachable([ck.guard, ck.cond], stop))
            r_in, r_pin = bool(reach & input_nodes), bool(reach & pinlike)
            cls = "both" if (r_in and r_pin) else "pins" if r_pin else "inputs"
            if cls == which:
                sel.append((i, ck))
        ns = base_namespace()
        em = Emitter(g, leaves, ns)
        out: list[str] = []
        idx = [i for i, _ in sel]
        avail: set[int] = set()
        em.speculate([ck.guard for _, ck in sel] + [ck.cond for _, ck in sel], out, avail, "    ")
        em.checks([ck for _, ck in sel], out, avail, "    ", "return _IDX[{i}]")
        ns["_IDX"] = idx
        args = ", ".join([f"p{j}" for j in range(len(self.pins))] + [f"k_{k}" for k in self.knob_names]
                         + self.inputs)
        src = f"def _check({args}):\n" + "\n".join(out) + "\n    return -1\n"
        fn = compile_source(src, ns, f"<selir checks {self.program}>")["_check"]
        self._checkers[which] = (fn, bool(sel))
        return self._checkers[which]

    # ---- the domain
    def default_knobs(self) -> tuple:
        return tuple(self.lw.knobs[k][1] for k in self.knob_names)

    def knob_settings(self) -> list[tuple]:
        choices = [self.lw.knobs[k][0] for k in self.knob_names]
        total = 1
        for c in choices:
            total *= len(c)
        if total <= 64:
            return list(itertools.product(*choices))
        base = self.default_knobs()
        out = {base}
        for i, c in enumerate(choices):
            for v in c:
                out.add(base[:i] + (v,) + base[i + 1:])
        return sorted(out, key=lambda t: [sort_key(x) for x in t])

    def points(self) -> list[tuple]:
        """Domain points (positional, in input order), fixed for a given program and facts."""
        if self._points is not None:
            return self._points
        doms = [self.lw.domains[n] for n in self.inputs]
        kn = self.default_knobs()
        sizes = [len(d[1]) if d[0] == "in" else (d[1] - d[0] + 1 if isinstance(d[0], int) and isinstance(d[1], int)
                                                 else float("inf")) for d in doms]
        total = 1
        for s in sizes:
            total *= s
        pts: list[tuple] = []
        if not self.inputs:
            pts = [()]
        elif total <= EXHAUSTIVE_LIMIT:
            axes = [list(d[1]) if d[0] == "in" else list(range(d[0], d[1] + 1)) for d in doms]
            pts = [p for p in itertools.product(*axes) if self._probe(*p, *kn) is not None]
        else:
            rnd = random.Random(self.seed)
            special = [self._special(d) for d in doms]
            seen: set[tuple] = set()
            combos = 1
            for s in special:
                combos *= len(s)
            cand: list[tuple] = []
            if combos <= SAMPLE_POINTS:
                cand.extend(itertools.product(*special))
            attempts = 0
            while len(pts) < SAMPLE_POINTS and attempts < SAMPLE_POINTS * 40:
                if cand:
                    p = cand.pop()
                else:
                    attempts += 1
                    mode = attempts % 2
                    p = tuple(rnd.choice(s) if mode == 0 else self._uniform(rnd, d) for s, d in zip(special, doms))
                if p in seen:
                    continue
                seen.add(p)
                if self._probe(*p, *kn) is not None:
                    pts.append(p)
        if not pts:
            raise lang.SelIRError(f"program {self.program!r}: no runtime input point satisfies its assumes "
                                  "for these facts (empty domain)")
        self._points = pts
        return pts

    @staticmethod
    def _special(d: tuple) -> list:
        if d[0] == "in":
            return list(d[1])
        lo, hi = d
        if not (isinstance(lo, int) and isinstance(hi, int)):
            return [lo, hi, (lo + hi) / 2]
        vals = {lo, hi, lo + 1, hi - 1, (lo + hi) // 2}
        p = 1
        while p <= hi:
            vals.update((p - 1, p, p + 1))
            p *= 2
        return sorted(v for v in vals if lo <= v <= hi)

    @staticmethod
    def _uniform(rnd: random.Random, d: tuple):
        if d[0] == "in":
            return rnd.choice(d[1])
        if isinstance(d[0], int) and isinstance(d[1], int):
            return rnd.randint(d[0], d[1])
        return rnd.uniform(d[0], d[1])

    def as_point(self, rt: dict[str, Any]) -> tuple | None:
        try:
            return tuple(rt[n] for n in self.inputs)
        except KeyError:
            return None

    # ---- values
    def values_at(self, point: tuple, knobs: tuple | None = None):
        """The pins' values at a point of the unpinned program (None if out of domain)."""
        return self._probe(*point, *(knobs if knobs is not None else self.default_knobs()))

    def candidates(self, profile: list[dict] = ()) -> dict[str, tuple]:
        seen: list[set] = [set() for _ in self.pins]
        for kn in self.knob_settings():
            for p in self.points():
                vals = self._probe(*p, *kn)
                if vals is None:
                    continue
                for j, v in enumerate(vals):
                    if v is not NOT_REACHED:
                        seen[j].add(v)
        for rt in profile:
            p = self.as_point(rt)
            vals = self._probe(*p, *self.default_knobs()) if p is not None else None
            if vals is not None:
                for j, v in enumerate(vals):
                    if v is not NOT_REACHED:
                        seen[j].add(v)
        return {name: tuple(sorted(s, key=sort_key)) for name, s in zip(self.pins, seen)}

    def profile_counts(self, profile: list[dict]) -> list[Counter]:
        counts = [Counter() for _ in self.pins]
        for rt in profile:
            p = self.as_point(rt)
            vals = self._probe(*p, *self.default_knobs()) if p is not None else None
            if vals is None:
                continue
            for j, v in enumerate(vals):
                if v is not NOT_REACHED:
                    counts[j][v] += 1
        return counts

    # ---- legality
    def check(self, pin_values: tuple, knob_values: tuple, skip_inputs: bool = False) -> tuple[int, tuple] | None:
        """None if legal, else (index of the failing check, the point)."""
        pts = self.points()
        fn, any_ = self._checker("inputs")
        if any_ and not skip_inputs:
            for p in pts:
                i = fn(*pin_values, *knob_values, *p)
                if i >= 0:
                    return (i, p)
        fn, any_ = self._checker("pins")
        if any_:
            i = fn(*pin_values, *knob_values, *pts[0])
            if i >= 0:
                return (i, pts[0])
        fn, any_ = self._checker("both")
        if any_:
            for p in pts:
                i = fn(*pin_values, *knob_values, *p)
                if i >= 0:
                    return (i, p)
        return None

    def legal(self, cands: dict[str, tuple]) -> list[tuple[tuple, tuple]]:
        """All legal (pin values, knob values) over candidates x knob choices."""
        settings = list(itertools.product(*cands.values())) if self.pins else [()]
        knobs = self.knob_settings()
        if len(settings) * len(knobs) > MAX_ASSIGNMENTS:
            raise lang.SelIRError(f"program {self.program!r}: {len(settings) * len(knobs)} candidate assignments "
                                  f"(limit {MAX_ASSIGNMENTS}); judge single assignments with is_legal()")
        fi, any_i = self._checker("inputs")
        if any_i:
            for p in self.points():
                if fi(*(settings[0]), *knobs[0], *p) >= 0:
                    return []
        out = []
        for kn in knobs:
            for pv in settings:
                if self.check(pv, kn, skip_inputs=True) is None:
                    out.append((pv, kn))
        return out

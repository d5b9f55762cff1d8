"""`solve`: partial evaluation, lowering, cut and VRA for one program and
deployment; `Solution.compile` turns an assignment into a selector.

    prog = parse_program(src)
    sol = solve(prog, facts)            # sol.pins, sol.candidates, sol.legal, sol.graph
    sel = sol.compile({"split_tokens": 256}, mode="pinned")
    sel(num_tokens=5, max_seqlen_k=300)  # -> {"impl": ..., ...}
"""
from __future__ import annotations

import itertools
import sys
import time
from typing import Any, Callable

from detent.selection.compiler import jitcache, lang, solve_cache
from detent.selection.compiler.codegen import Emitter, base_namespace, compile_source
from detent.selection.compiler.cut import GraphStats, min_vertex_cut, stats, taint
from detent.selection.compiler.lower import Lowered, lower, lower_conservative
from detent.selection.compiler.vra import VRA, sort_key

MODES = ("pinned", "stock", "conservative")
MEMO_CAP = 65536
_MISSING = object()


class IllegalAssignment(lang.SelIRError):
    """An assignment that names an unknown pin/knob, lacks a pin, or is not legal."""


def _facts_for(prog: lang.Program, facts: dict[str, Any], stock: bool) -> dict[str, Any]:
    f = dict(facts)
    if any(p.name == "stock_kernels" for p in prog.params):
        f["stock_kernels"] = stock
    return f


class Solution:
    def __init__(self, prog: lang.Program, facts: dict[str, Any], lw: Lowered, pins: dict[str, int],
                 gstats: GraphStats, level: str, seconds: float, cache_key: str | None, vra_data: dict | None):
        self.program, self.facts, self.lowered, self.level = prog, facts, lw, level
        self.pin_nodes = pins
        self.pins: tuple[str, ...] = tuple(pins)
        self.graph = gstats
        self.seconds = seconds
        self.from_cache = False
        self._key = cache_key
        self._vra: VRA | None = None
        self._vra_data = dict(vra_data or {})
        self._stock: Lowered | None = None
        self._legal_set: set | None = None

    # ---- VRA (lazy; results go back into the JIT cache)
    @property
    def vra(self) -> VRA:
        if self._vra is None:
            self._vra = VRA(self.lowered, self.pin_nodes, self.program.name)
        return self._vra

    @property
    def knobs(self) -> dict[str, tuple]:
        return dict(self.lowered.knobs)

    def profile(self) -> list[dict]:
        from detent.selection.compiler.profile import default_profile
        return default_profile(self.facts)

    @property
    def candidates(self) -> dict[str, tuple]:
        if "candidates" not in self._vra_data:
            self._vra_data["candidates"] = self.vra.candidates(self.profile())
            self._save()
        return self._vra_data["candidates"]

    @property
    def legal(self) -> list[dict]:
        """Every legal assignment, as {pin: value, ..., knob: value}."""
        if "legal" not in self._vra_data:
            self._vra_data["legal"] = self.vra.legal(self.candidates)
            self._save()
        return [self._as_dict(pv, kv) for pv, kv in self._vra_data["legal"]]

    @property
    def num_candidates(self) -> int:
        n = 1
        for v in self.candidates.values():
            n *= len(v)
        return n * len(self.vra.knob_settings())

    def _as_dict(self, pv: tuple, kv: tuple) -> dict:
        d = dict(zip(self.pins, pv))
        d.update(zip(self.lowered.knobs, kv))
        return d

    def _save(self) -> None:
        if self._key is not None:
            jitcache.store(self._key, self._payload())

    def _payload(self) -> dict:
        """What the JIT cache keeps: data about the lowered graph, never the graph itself."""
        return {"graph": solve_cache.fingerprint(self.lowered), "pins": self.pin_nodes, "stats": self.graph.as_dict(),
                "level": self.level, "seconds": self.seconds,
                "vra": {k: v for k, v in self._vra_data.items() if k != "judged"}}  # judged: re-checked per process

    # ---- assignments
    def split(self, assignment: dict[str, Any] | None) -> tuple[tuple, tuple]:
        assignment = dict(assignment or {})
        knob_names = list(self.lowered.knobs)
        unknown = [k for k in assignment if k not in self.pin_nodes and k not in self.lowered.knobs]
        if unknown:
            raise IllegalAssignment(f"program {self.program.name!r}: unknown pin or knob {unknown[0]!r} "
                                    f"(pins: {list(self.pins)}, knobs: {knob_names})")
        missing = [p for p in self.pins if p not in assignment]
        if missing:
            raise IllegalAssignment(f"program {self.program.name!r}: the assignment gives no value for pin "
                                    f"{missing[0]!r} (pins: {list(self.pins)})")
        kv = []
        for k in knob_names:
            choices, default = self.lowered.knobs[k]
            v = assignment.get(k, default)
            if v not in choices:
                raise IllegalAssignment(f"program {self.program.name!r}: knob {k!r} = {v!r} is not one of "
                                        f"{list(choices)}")
            kv.append(v)
        return tuple(assignment[p] for p in self.pins), tuple(kv)

    def why_illegal(self, assignment: dict[str, Any]) -> str | None:
        """None if legal; else a message naming the pin, the failed condition and the legal values."""
        pv, kv = self.split(assignment)
        bad = self.vra.check(pv, kv)
        if bad is None:
            return None
        i, point = bad
        ck = self.lowered.checks[i]
        at = ", ".join(f"{n}={v}" for n, v in zip(self.vra.inputs, point))
        parts = []
        for j, p in enumerate(self.pins):
            ok = [c for c in self.candidates.get(p, ())
                  if self.vra.check(pv[:j] + (c,) + pv[j + 1:], kv) is None]
            if pv[j] not in ok and ok:  # no legal value at all: not this pin's doing (a knob's, a fact's)
                parts.append(f"pin {p!r} = {pv[j]!r} is not legal here; its legal values: {_fmt(ok)}")
        knobs = dict(zip(self.lowered.knobs, kv))
        head = "; ".join(parts) or (f"no pin values are legal with knobs {knobs}" if knobs
                                    else f"assignment {assignment} is not legal")
        return (f"program {self.program.name!r}: {head} ({ck.kind} `{ck.text}` fails at {at}"
                f"{': ' + ck.msg if ck.msg else ''}; {ck.where})")

    def is_legal(self, assignment: dict[str, Any]) -> bool:
        return self.why_illegal(assignment) is None

    def default_assignment(self, profile: list[dict] | None = None) -> dict:
        """Each pin at the legal value the unpinned program takes most often on the
        profile (ties: the smaller value), knobs at default."""
        if profile is None:
            if "default" not in self._vra_data:
                self._vra_data["default"] = self._default(None)
                self._judged().add(jitcache.canonical(self._vra_data["default"]))
                self._save()
            return dict(self._vra_data["default"])
        return self._default(profile)

    def _judged(self) -> set:
        return self._vra_data.setdefault("judged", set())

    def _default(self, profile: list[dict] | None) -> dict:
        prof = self.profile() if profile is None else profile
        kv = self.vra.default_knobs()
        if not self.pins:
            return self._as_dict((), kv)
        counts = self.vra.profile_counts(prof)
        cands = self.candidates
        ranked = []
        for j, p in enumerate(self.pins):
            order = sorted(cands[p], key=lambda v: (-counts[j][v], sort_key(v)))
            ranked.append(order)
        # greedy: most frequent per pin, then fall back pin by pin, in frequency order
        best = tuple(r[0] for r in ranked if r) if all(ranked) else None
        if best is not None and self.vra.check(best, kv) is None:
            return self._as_dict(best, kv)
        scored = []
        limit = 0
        for combo in itertools.product(*ranked):
            limit += 1
            if limit > 50_000:
                break
            score = sum(counts[j][v] for j, v in enumerate(combo))
            scored.append((-score, [sort_key(v) for v in combo], combo))
        scored.sort()
        for _, _, combo in scored:
            if self.vra.check(combo, kv) is None:
                return self._as_dict(combo, kv)
        first = self._as_dict(best, kv) if best is not None else None
        why = self.why_illegal(first) if first is not None else None
        raise IllegalAssignment(f"program {self.program.name!r}: no legal assignment for these facts "
                                f"(candidates: {cands}){'; e.g. ' + why if why else ''}")

    # ---- selectors
    def stock_lowered(self) -> Lowered:
        if self._stock is None:
            self._stock = lower(self.program, _facts_for(self.program, self.facts, True), self.level)
        return self._stock

    def compile(self, assignment: dict[str, Any] | None = None, mode: str = "pinned",
                check_legal: bool = True) -> Callable[..., dict]:
        """A compiled selector: `sel(**runtime) -> {selection point: value}`."""
        if mode not in MODES:
            raise ValueError(f"selection mode must be one of {MODES}, got {mode!r}")
        if mode == "conservative":
            const = lower_conservative(self.program, _facts_for(self.program, self.facts, False))
            domain = [c for c in self.lowered.checks if c.domain]
            return build_selector(self.lowered, self.program, {}, {}, "conservative", {}, checks=domain,
                                  constant=const)
        if mode == "stock":
            lw = self.stock_lowered()
            knobs = {k: v for k, v in (assignment or {}).items() if k in lw.knobs}
            return build_selector(lw, self.program, {}, knobs, "stock", knobs)
        if assignment is None:
            assignment = self.default_assignment()
        pv, kv = self.split(assignment)
        if check_legal:
            key = jitcache.canonical(self._as_dict(pv, kv))
            if key not in self._judged():
                why = self.why_illegal(assignment)
                if why is not None:
                    raise IllegalAssignment(why)
                self._judged().add(key)
        pins = {self.pin_nodes[p]: v for p, v in zip(self.pins, pv)}
        knobs = dict(zip(self.lowered.knobs, kv))
        return build_selector(self.lowered, self.program, pins, knobs, "pinned", self._as_dict(pv, kv))

    def repin(self, assignment: dict[str, Any]) -> Callable[..., dict]:
        """Same pins, new values: regenerate the selector without solving."""
        return self.compile(assignment, mode="pinned")

    def __repr__(self) -> str:
        return (f"Solution({self.program.name!r}, pins={list(self.pins)}, nodes={self.graph.nodes}, "
                f"batch_dependent_points={list(self.graph.batch_dependent_points)})")


def _fmt(vals: list, limit: int = 24) -> str:
    s = ", ".join(repr(v) for v in vals[:limit])
    return "[" + s + (f", ... ({len(vals)} in all)" if len(vals) > limit else "") + "]"


def build_selector(lw: Lowered, prog: lang.Program, pins: dict[int, Any], knobs: dict[str, Any], mode: str,
                   assignment: dict, checks=None, constant: dict | None = None) -> Callable[..., dict]:
    g = lw.graph
    ns = base_namespace()
    leaves = {n: name for name, n in lw.inputs.items()}
    known = dict(pins)
    for name, (choices, default) in lw.knobs.items():
        known[g._memo[("knob", name)]] = knobs.get(name, default)
    em = Emitter(g, leaves, ns, known)
    checks = lw.checks if checks is None else checks
    roots = [c.guard for c in checks] + [c.cond for c in checks]
    if constant is None:
        roots += list(lw.outputs.values())
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 20000))
    try:
        reach = em.live(roots)
    finally:
        sys.setrecursionlimit(old)
    reads = [name for name, n in lw.inputs.items() if n in reach]
    out: list[str] = []
    avail: set[int] = set()
    em.speculate(roots, out, avail, "    ")
    em.checks(checks, out, avail, "    ", "_fail({i}, (" + "".join(r + ", " for r in reads) + "))")
    if constant is None:
        rec = em.record(lw.outputs, out, avail, "    ")
    else:
        ns["_CONST"] = dict(constant)
        rec = "_CONST"
    args = ", ".join(reads)
    src = [f"def _slow({args}):"] + out + [f"    return {rec}", ""]
    if reads:
        key = reads[0] if len(reads) == 1 else "(" + args + ")"
        kw = ", ".join(f"{r}=_MISSING" for r in reads)
        src += [f"def select(*, {kw}, **_rest):",
                f"    r = _memo.get({key})",
                "    if r is None:",
                f"        r = _miss({args})",
                "    return r",
                "",
                f"def _miss({args}):",
                f"    if _MISSING in ({args},):",
                f"        _missing(({args},))",
                f"    r = _slow({args})",
                "    if len(_memo) >= _CAP:",
                "        _memo.clear()",
                f"    _memo[{key}] = r",
                "    return r", ""]
    else:
        src += ["_R = _slow()", "def select(**_rest):", "    return _R", ""]
    source = "\n".join(src)

    def _fail(i: int, vals: tuple):
        ck = checks[i]
        at = ", ".join(f"{n}={v!r}" for n, v in zip(reads, vals))
        pinned = f"; pins {assignment}" if mode == "pinned" else ""
        raise lang.SelectionError(
            f"SelIR program {prog.name!r} ({ck.where}): {ck.kind} failed: `{ck.text}`"
            f"{' — ' + ck.msg if ck.msg else ''}; runtime inputs: {at} (mode {mode}{pinned})")

    def _missing(vals: tuple):
        gone = [n for n, v in zip(reads, vals) if v is _MISSING]
        raise lang.SelectionError(f"selector for program {prog.name!r} needs runtime input(s) {gone}")

    ns.update(_fail=_fail, _missing=_missing, _MISSING=_MISSING, _memo={}, _CAP=MEMO_CAP)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 20000))
    try:
        fn = compile_source(source, ns, f"<selir {prog.name} {mode}>")["select"]
    finally:
        sys.setrecursionlimit(old)
    fn.source = source
    fn.mode = mode
    fn.assignment = dict(assignment)
    fn.reads = tuple(reads)
    fn.program = prog.name
    return fn


_MEMORY: dict[str, Solution] = {}


def _lower(prog: lang.Program, f: dict[str, Any], level: str) -> Lowered:
    lw = lower(prog, f, level)
    for k, n in list(lw.outputs.items()):
        if lw.graph.ops[n] == "input":
            lw.outputs[k] = lw.graph.copy(n, k)
    return lw


def solve(prog: lang.Program, facts: dict[str, Any], level: str = "full", cut: bool = True,
          cache: bool = True, memory: bool = True) -> Solution:
    """Specialize `prog` to `facts`, lower it, and find its pins.

    level: "full" (all simplifications) or "fold" (constant folding only);
    cut=False pins every batch-dependent selection point instead of a cut.
    cache: use the on-disk JIT cache; memory: reuse this process's solutions."""
    f = _facts_for(prog, facts, False)
    key = jitcache.key(prog.source, f, level=level, cut=cut) if cache else None
    if key is not None and memory and key in _MEMORY:
        return _MEMORY[key]
    if key is not None:
        hit = jitcache.load(key)
        sol = (solve_cache.from_cache(prog, f, level, key, hit, _lower(prog, f, level), Solution)
               if hit is not None else None)
        if sol is not None:
            if memory:
                _MEMORY[key] = sol
            return sol
    t0 = time.perf_counter()
    lw = _lower(prog, f, level)
    g = lw.graph
    order = g.reachable(list(lw.outputs.values()))
    tainted, _ = taint(g, order)
    points = [k for k, n in lw.outputs.items() if n in tainted]
    if cut:
        c = min_vertex_cut(g, lw.outputs, prog.name)
        nodes = c.pins
    else:
        nodes = tuple(dict.fromkeys(lw.outputs[k] for k in points))
    out_names = {}
    for k, n in lw.outputs.items():
        out_names.setdefault(n, k)
    users: dict[int, int] = {}
    for n in order:
        for a in g.args[n]:
            users.setdefault(a, n)
    pins: dict[str, int] = {}
    for n in nodes:
        name = out_names.get(n) or (g.names[n][0] if g.names[n] else None)
        if name is None:  # an unnamed value: name it after the value it feeds (".cond" if as a condition)
            prev, u, hops = n, users.get(n), 0
            while u is not None and not (out_names.get(u) or g.names[u]) and hops < 50:
                prev, u, hops = u, users.get(u), hops + 1
            cond = u is not None and g.ops[u] == "phi" and g.args[u][0] == prev
            name = f"{out_names.get(u) or g.names[u][0]}{'.cond' if cond else ''}" if u is not None else f"v{n}"
        base, i = name, 2
        while name in pins:
            name, i = f"{base}_{i}", i + 1
        pins[name] = n
    gs = stats(g, lw.outputs, lw.checks, points, len(lw.inputs), len(tainted))
    sol = Solution(prog, f, lw, pins, gs, level, time.perf_counter() - t0, key, None)
    sol._save()
    if key is not None and memory:
        _MEMORY[key] = sol
    return sol

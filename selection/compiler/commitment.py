"""The commitment tuple (docs/selir.md section 5): a legal value for every pin and
a setting for every knob, per kernel family, fixed for a deployment.

    {"format": "detent-tuple/1", "selir_version": "1",
     "deployment": {"facts": {...}, "hash": "<sha256 of the facts>"},
     "families": {"attention": {"pins": {"split_tokens": 256},
                                "knobs": {"split_stride": 256},
                                "sites": {"<site key>": {"pins": {...}, "knobs": {...}}}}}}

A family's "pins"/"knobs" apply to all its call sites; "sites" overrides them
for one site (site key: `facts.site_key`). Nothing is filled in: a family the
deployment selects through (one with pins or knobs), or a pin or knob of it,
that the tuple leaves out is refused, naming it. Loading refuses malformed or
too deeply nested JSON, an unknown format or family, pin values that are not
JSON scalars (or lists of them), facts that differ from this deployment's
(naming the fact), and every value that is not one of its legal values: a
pin must be one of the values the program itself reaches (the VRA's
candidates, same type) and pass every require/assume; a knob one of its
choices. So a validated tuple cannot fail at run time.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from detent.selection import programs
from detent.selection.facts import deployment_hash, site_key, sites_for
from detent.selection.compiler.jitcache import canonical
from detent.selection.compiler.lang import SELIR_VERSION, SelIRError
from detent.selection.compiler.solver import IllegalAssignment, _fmt
from detent.selection.compiler.vra import sort_key

FORMAT = "detent-tuple/1"
MAX_DEPTH = 16  # a tuple is 6 levels deep; pin values may hold a tuple or two
_SCALARS = (bool, int, float, str, type(None))


class TupleError(ValueError):
    """A commitment tuple that cannot be used for this deployment."""


def _tuples(v: Any) -> Any:
    """JSON has no tuples: lists in pin values come back as tuples."""
    if isinstance(v, list):
        return tuple(_tuples(x) for x in v)
    if isinstance(v, dict):
        return {k: _tuples(x) for k, x in v.items()}
    return v


def _depth(v: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        if isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
    return deepest


def _check_values(where: str, values: Any) -> None:
    for k, v in values.items():
        flat = v if isinstance(v, list) else [v]
        if not all(isinstance(x, _SCALARS) or (isinstance(x, list) and all(isinstance(y, _SCALARS) for y in x))
                   for x in flat):
            raise TupleError(f"{where}.{k}: a pin or knob value is a number, string, boolean or a list of them, "
                             f"got {json.dumps(v)[:80]}")


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type (JSON's 1 is not True, 16 is not 16.0)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _parse_site(key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in key.split(","):
        if "=" not in part:
            raise TupleError(f"malformed site key {key!r} (expected 'name=value,...')")
        k, v = part.split("=", 1)
        out[k] = int(v) if v.lstrip("-").isdigit() else {"True": True, "False": False}.get(v, v)
    return out


@dataclass
class CommitmentTuple:
    facts: dict[str, Any]
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<tuple>"

    # ---- (de)serialisation
    def to_dict(self) -> dict:
        return {"format": FORMAT, "selir_version": SELIR_VERSION,
                "deployment": {"facts": self.facts, "hash": deployment_hash(self.facts)},
                "families": self.families}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @property
    def hash(self) -> str:
        return tuple_hash(self)

    @classmethod
    def from_json(cls, text: str, source: str = "<tuple>") -> "CommitmentTuple":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TupleError(f"{source}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        except RecursionError:
            raise TupleError(f"{source}: JSON nested too deeply (a tuple is at most {MAX_DEPTH} levels)") from None
        if _depth(d) > MAX_DEPTH:
            raise TupleError(f"{source}: JSON nested more than {MAX_DEPTH} levels deep (a tuple is 6)")
        if not isinstance(d, dict):
            raise TupleError(f"{source}: a commitment tuple is a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise TupleError(f"{source}: field 'format' is {d.get('format')!r}, expected {FORMAT!r}")
        if str(d.get("selir_version")) != SELIR_VERSION:
            raise TupleError(f"{source}: field 'selir_version' is {d.get('selir_version')!r}; this engine runs "
                             f"SelIR {SELIR_VERSION!r} (re-solve and save the tuple again)")
        dep = d.get("deployment")
        if not isinstance(dep, dict) or not isinstance(dep.get("facts"), dict):
            raise TupleError(f"{source}: field 'deployment.facts' is missing or not an object")
        if dep.get("hash") != deployment_hash(dep["facts"]):
            raise TupleError(f"{source}: field 'deployment.hash' does not match 'deployment.facts' "
                             "(the tuple was edited by hand?)")
        fams = d.get("families", {})
        if not isinstance(fams, dict):
            raise TupleError(f"{source}: field 'families' must be an object")
        for name, ent in fams.items():
            if name not in programs.FAMILIES:
                raise TupleError(f"{source}: unknown family {name!r} (families: {list(programs.FAMILIES)})")
            if not isinstance(ent, dict) or set(ent) - {"pins", "knobs", "sites"}:
                raise TupleError(f"{source}: families.{name} must be an object with 'pins', 'knobs', 'sites'")
            for part in ("pins", "knobs", "sites"):
                if not isinstance(ent.get(part, {}), dict):
                    raise TupleError(f"{source}: families.{name}.{part} must be an object")
            for part in ("pins", "knobs"):
                _check_values(f"{source}: families.{name}.{part}", ent.get(part, {}))
            for sk, sv in ent.get("sites", {}).items():
                _parse_site(sk)
                if not isinstance(sv, dict) or set(sv) - {"pins", "knobs"}:
                    raise TupleError(f"{source}: families.{name}.sites[{sk!r}] must be an object with 'pins', 'knobs'")
                for part in ("pins", "knobs"):
                    if not isinstance(sv.get(part, {}), dict):
                        raise TupleError(f"{source}: families.{name}.sites[{sk!r}].{part} must be an object")
                    _check_values(f"{source}: families.{name}.sites[{sk!r}].{part}", sv.get(part, {}))
        return cls(dep["facts"], _tuples(fams), source)

    @classmethod
    def load(cls, path: str) -> "CommitmentTuple":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise TupleError(f"cannot read commitment tuple {path}: {e.strerror}") from None
        return cls.from_json(text, path)

    # ---- use
    def assignment_for(self, family: str, site: dict[str, Any]) -> dict[str, Any]:
        """The tuple's pins and knobs for one call site (possibly partial)."""
        ent = self.families.get(family, {})
        out = dict(ent.get("pins", {}))
        out.update(ent.get("knobs", {}))
        s = ent.get("sites", {}).get(site_key(site), {})
        out.update(s.get("pins", {}))
        out.update(s.get("knobs", {}))
        return out

    def check_facts(self, facts: dict[str, Any]) -> None:
        for k in sorted(set(self.facts) | set(facts)):
            a, b = self.facts.get(k, "<absent>"), facts.get(k, "<absent>")
            if _tuples(a) != _tuples(b):
                raise TupleError(f"{self.source}: deployment fact {k!r} differs: the tuple was made for {a!r}, "
                                 f"this deployment has {b!r}")

    def validate(self, facts: dict[str, Any], legal: bool = True) -> None:
        """Refuse the tuple for this deployment: facts mismatch, a family, pin or
        knob left out, or a value that is not legal, at any site of any family."""
        self.check_facts(facts)
        if not legal:
            return
        for fam in programs.FAMILIES:
            sites = {site_key(s): s for s in sites_for(facts, fam)}
            for sk in self.families.get(fam, {}).get("sites", {}):
                sites.setdefault(sk, _parse_site(sk))
            for s in sites.values():
                resolve(fam, facts, s, self)


def resolve(family: str, facts: dict[str, Any], site: dict[str, Any], t: CommitmentTuple | None):
    """(solution, assignment) for one site: the tuple's values over the defaults,
    checked for legality (TupleError naming the family, site and pin)."""
    from detent.selection.compiler.solver import solve
    sol = solve(programs.load(family), {**facts, **site})
    given = t.assignment_for(family, site) if t is not None else {}
    try:
        unknown = [k for k in given if k not in sol.pin_nodes and k not in sol.lowered.knobs]
        if unknown:
            raise IllegalAssignment(f"unknown pin or knob {unknown[0]!r} (pins: {list(sol.pins)}, "
                                    f"knobs: {list(sol.lowered.knobs)})")
        if t is None:
            assignment = dict(sol.default_assignment())
        else:
            _complete_and_typed(sol, family, given, t)
            assignment = dict(given)
        why = sol.why_illegal(assignment)
    except (IllegalAssignment, SelIRError) as e:
        src = t.source if t is not None else "default tuple"
        raise TupleError(f"{src}: family {family!r}, site {site_key(site)}: {e}") from None
    if why is not None:
        src = t.source if t is not None else "default tuple"
        raise TupleError(f"{src}: family {family!r}, site {site_key(site)}: {why}")
    return sol, assignment


def _complete_and_typed(sol, family: str, given: dict[str, Any], t: CommitmentTuple) -> None:
    """IllegalAssignment unless the tuple gives every pin and knob, each one of its legal values."""
    needed = list(sol.pins) + list(sol.lowered.knobs)
    if needed and family not in t.families:
        raise IllegalAssignment(f"the tuple has no entry for family {family!r}, which this deployment selects "
                                f"through (pins: {list(sol.pins)}, knobs: {list(sol.lowered.knobs)}); nothing is "
                                "filled in by default (`detent tuple default` writes a complete tuple)")
    missing = [k for k in needed if k not in given]
    if missing:
        kind = "pin" if missing[0] in sol.pin_nodes else "knob"
        raise IllegalAssignment(f"no value for {kind} {missing[0]!r} (pins: {list(sol.pins)}, knobs: "
                                f"{list(sol.lowered.knobs)}); nothing is filled in by default")
    for k, (choices, _) in sol.lowered.knobs.items():
        if not any(_same(given[k], c) for c in choices):
            raise IllegalAssignment(f"knob {k!r} = {given[k]!r} is not one of {list(choices)}")
    for p in sol.pins:
        cands = sol.candidates.get(p, ())
        if not any(_same(given[p], c) for c in cands):
            legal = sorted({a[p] for a in sol.legal}, key=sort_key)
            raise IllegalAssignment(f"pin {p!r} = {given[p]!r} is not one of its legal values: "
                                    f"{_fmt(legal)} (the values the program reaches that pass its checks)")


def default_tuple(facts: dict[str, Any], families: tuple[str, ...] | None = None,
                  knobs: dict[str, dict[str, Any]] | None = None) -> CommitmentTuple:
    """Each pin at the legal value the unpinned program takes most often on the
    default profile, knobs at default; per family, with per-site overrides only
    where a site's default differs from the family's most common one.
    `knobs` ({family: {knob: value}}) sets knobs for the whole family, e.g.
    {"attention": {"impl": "fa4"}}, checked at every site (TupleError)."""
    t = _default_tuple(facts, families)
    for fam, kv in (knobs or {}).items():
        ent = t.families.setdefault(fam, {"pins": {}, "knobs": {}, "sites": {}})
        ent["knobs"].update(kv)
        for site in ent["sites"].values():
            site["knobs"].update({k: v for k, v in kv.items() if k in site["knobs"]})
        for s in sites_for(facts, fam):
            resolve(fam, facts, s, t)
    return t


def _default_tuple(facts: dict[str, Any], families: tuple[str, ...] | None) -> CommitmentTuple:
    t = CommitmentTuple(dict(facts), {}, "default tuple")
    for fam in families or programs.FAMILIES:
        per_site = []
        for s in sites_for(facts, fam):
            sol, a = resolve(fam, facts, s, None)
            per_site.append((s, a))
        if not per_site or not any(a for _, a in per_site):
            continue
        keyed = [canonical(a) for _, a in per_site]
        common = max(set(keyed), key=lambda k: (keyed.count(k), k))
        base = next(a for (_, a), k in zip(per_site, keyed) if k == common)
        knob_names = set()
        for s, _ in per_site:
            knob_names |= set(solve_knobs(fam, facts, s))
        ent: dict[str, Any] = {"pins": {k: v for k, v in base.items() if k not in knob_names},
                               "knobs": {k: v for k, v in base.items() if k in knob_names}, "sites": {}}
        for (s, a), k in zip(per_site, keyed):
            if k != common:
                ent["sites"][site_key(s)] = {"pins": {x: v for x, v in a.items() if x not in knob_names},
                                             "knobs": {x: v for x, v in a.items() if x in knob_names}}
        t.families[fam] = ent
    return t


def solve_knobs(family: str, facts: dict[str, Any], site: dict[str, Any]) -> list[str]:
    from detent.selection.compiler.solver import solve
    return list(solve(programs.load(family), {**facts, **site}).lowered.knobs)


def tuple_hash(t: CommitmentTuple | dict) -> str:
    """sha256 over the canonical JSON of the tuple (hex): what a response carries."""
    d = t.to_dict() if isinstance(t, CommitmentTuple) else t
    return hashlib.sha256(canonical(d).encode()).hexdigest()

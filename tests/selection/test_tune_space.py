"""The tuner's search space (selection/compiler/tune_space.py) and its grid
thinning (detent/tune_search.py) on the tiny Llama's CPU facts: the legal
family-wide assignments are exactly the VRA's legal sets intersected over the
family's sites, every one of them loads, and an illegal one is refused by the
tuple loader."""
from __future__ import annotations

import pytest

from detent.selection import CommitmentTuple, TupleError, default_facts_for, default_tuple, programs, solve
from detent.selection.compiler.jitcache import canonical
from detent.selection.compiler.tune_space import family_assignment, family_space, with_family
from detent.selection.facts import sites_for
from detent.tune_search import _rungs, spread

CFG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 160}


@pytest.fixture(scope="module")
def facts():
    from detent.selection.facts import complete
    return complete(default_facts_for(CFG, max_context=512, max_num_batched_tokens=32, max_num_seqs=64))


def test_legal_space_is_the_vra_legal_set_at_every_site(facts):
    for fam in ("gemm", "attention"):
        space = family_space(facts, fam)
        per_site = [{canonical(a) for a in solve(programs.load(fam), {**facts, **s}).legal}
                    for s in sites_for(facts, fam)]
        assert {canonical(a) for a in space.legal} == set.intersection(*per_site)
        assert len(space.legal) > 1
    assert family_space(facts, "gemm").axes == {"chunk": (1, 16)}
    att = family_space(facts, "attention")
    assert att.pins == ("split_tokens",) and att.knobs == ("split_stride",)
    assert family_space(facts, "norm") is None and family_space(facts, "moe") is None  # nothing to choose


def test_every_legal_assignment_loads_and_an_illegal_one_is_refused(facts):
    base = default_tuple(facts)
    space = family_space(facts, "attention")
    for a in space.legal[::7]:
        t = with_family(base, space, a)
        CommitmentTuple.from_json(t.to_json()).validate(facts)
        assert family_assignment(t, "attention") == a
    bad = with_family(base, space, {"split_tokens": 24, "split_stride": 256})  # not a multiple of the page
    with pytest.raises(TupleError, match="split_tokens"):
        CommitmentTuple.from_json(bad.to_json()).validate(facts)


def test_neighbours_step_one_legal_value_along_each_axis(facts):
    space = family_space(facts, "attention")
    nb = space.neighbours({"split_tokens": 256, "split_stride": 256})
    assert nb == [{"split_tokens": 240, "split_stride": 256}, {"split_tokens": 272, "split_stride": 256},
                  {"split_tokens": 256, "split_stride": 64}, {"split_tokens": 256, "split_stride": 1024}]


def test_spread_thins_every_axis_and_puts_the_default_first(facts):
    space = family_space(facts, "attention")
    default = family_assignment(default_tuple(facts), "attention")
    cands = spread(space, 8, default)
    assert cands[0] == default and len(cands) <= 9
    assert all(a in space.legal for a in cands)
    assert len({a["split_stride"] for a in cands[1:]}) >= 2 and len({a["split_tokens"] for a in cands[1:]}) >= 2
    whole = spread(space, 10_000, default)  # a budget past the grid: every legal assignment, once
    assert sorted(map(space.key, whole[1:])) == sorted(space.key(a) for a in space.legal if a != default)


def test_rungs():
    assert _rungs(0.25, 3) == [0.25, 0.75, 1.0]
    assert _rungs(1.0, 3) == [1.0]
    assert _rungs(0.1, 2) == [0.1, 0.2, 0.4, 0.8, 1.0]


def test_search_with_nothing_to_choose_keeps_the_default_tuple(facts):
    from detent.tune_search import Search

    class Flat:
        def measure(self, t, fraction):
            return 1.0
    res = Search(default_tuple(facts), Flat(), facts).run([])
    assert res.chosen.hash == default_tuple(facts).hash and res.checks == [] and res.delta == 0.0


def test_signature_equal_only_when_the_selections_are(facts):
    from detent.selection.compiler.tune_space import signature
    space = family_space(facts, "attention")
    (site,) = sites_for(facts, "attention")
    inputs = {tuple(sorted(site.items())): [dict(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=40, total_kv=40),
                                            dict(num_tokens=20, num_seqs=1, max_seqlen_q=20, max_seqlen_k=20,
                                                 total_kv=20)]}
    sig = lambda a: signature(space, facts, a, inputs)  # noqa: E731
    assert sig({"split_tokens": 32, "split_stride": 16}) == sig({"split_tokens": 32, "split_stride": 1024})
    assert sig({"split_tokens": 32, "split_stride": 16}) != sig({"split_tokens": 48, "split_stride": 16})


def test_search_measures_one_assignment_per_signature(facts):
    from detent.tune_search import Search
    space = family_space(facts, "attention")

    class Count:
        seen = 0

        def measure(self, t, fraction):
            self.seen += 1
            return float(family_assignment(t, "attention")["split_tokens"] // 128)  # 0 below 128, ...
    cost = Count()
    sig = lambda a: a["split_tokens"] // 128  # noqa: E731  (a stand-in: selections alike in blocks of 128)
    res = Search(default_tuple(facts), cost, facts, max_candidates=10_000, min_fraction=1.0, refine=0,
                 interactions=0, signatures={"attention": sig}).run([space])
    att = res.families["attention"]
    assert att.inert == ["split_stride"]
    classes = {sig(a) for a in space.legal}
    # the default three times (warm-up, first, last), one per class, and the combined tuple (additivity)
    assert cost.seen == 3 + len(classes) + 1
    assert [t for t in att.tried if "same_as" in t] and all(sig(t["same_as"]) == sig(t["assignment"])
                                                            for t in att.tried if "same_as" in t)
    assert att.chosen["split_tokens"] < 128


class Clocked:
    """A cost on a fake clock: each measurement takes 10 s per whole workload. The other gemm
    value is 10 cheaper than the default; every attention repin is 5 dearer."""

    def __init__(self, base):
        self.base, self.now, self.starts = base, 0.0, []

    def measure(self, t, fraction):
        self.starts.append(self.now)
        self.now += 10.0 * fraction
        cost = 100.0
        if family_assignment(t, "gemm") != family_assignment(self.base, "gemm"):
            cost -= 10.0
        if family_assignment(t, "attention") != family_assignment(self.base, "attention"):
            cost += 5.0
        return cost


@pytest.mark.parametrize("deadline", [20.0, 60.0])
def test_a_deadline_stops_the_search_and_only_a_measured_tuple_is_chosen(facts, deadline):
    # the default's two runs (20 s) always happen; gemm's two candidates take 20 s more, and at 60 s
    # the deadline cuts the attention family after two of its candidates
    from detent.tune_search import Search
    base = default_tuple(facts)
    cost = Clocked(base)
    spaces = [family_space(facts, "gemm"), family_space(facts, "attention")]
    res = Search(base, cost, facts, min_fraction=1.0, refine=0, deadline=deadline,
                 clock=lambda: cost.now).run(spaces)
    assert all(start < deadline for start in cost.starts)  # no measurement started after the deadline
    assert res.checks == [] and res.cut is not None
    assert res.families["attention"].chosen == family_assignment(base, "attention")
    if deadline == 20.0:  # nothing but the default was measured: the default is the tuple
        assert res.cut.startswith("family gemm") and res.kept_default and res.chosen.hash == base.hash
        assert cost.starts == [0.0, 10.0]
    else:  # gemm's cheaper value, measured on the whole workload, alone
        assert res.cut.startswith("family attention") and not res.kept_default
        assert family_assignment(res.chosen, "gemm") != family_assignment(base, "gemm")
        assert family_assignment(res.chosen, "attention") == family_assignment(base, "attention")
        assert len(cost.starts) == 2 + 2 + 2


def test_without_a_deadline_the_same_search_runs_to_the_additivity_check(facts):
    from detent.tune_search import Search
    base = default_tuple(facts)
    cost = Clocked(base)
    spaces = [family_space(facts, "gemm"), family_space(facts, "attention")]
    res = Search(base, cost, facts, min_fraction=1.0, refine=0, max_candidates=4, interactions=0).run(spaces)
    assert res.cut is None and res.checks and not res.kept_default


def test_a_deadline_shortens_the_first_rung_so_the_search_reaches_the_whole_workload(facts):
    # a measurement takes 40 s per whole workload; 24 candidates at a quarter take 240 s, and the
    # halving's second rung 240 s more: past a deadline 450 s after the default's two runs, the
    # search would be cut inside its second rung with nothing measured whole, keeping the default
    from detent.tune_search import Search
    base = default_tuple(facts)
    space = family_space(facts, "attention")
    default = family_assignment(base, "attention")
    cands = spread(space, 32, default)
    target = cands[1]

    class Slow:
        now, starts = 0.0, []

        def measure(self, t, fraction):
            self.starts.append((self.now, fraction))
            self.now += 40.0 * fraction
            a = family_assignment(t, "attention")
            return 100.0 if a == default else 95.0 if a == target else 101.0
    cost = Slow()
    res = Search(base, cost, facts, refine=0, interactions=0, deadline=80.0 + 450.0,
                 clock=lambda: cost.now).run([space])
    first = [s for s in cost.starts if s[1] == 0.25]
    assert 2 <= len(first) < len(cands)  # the first rung stopped early
    assert res.cut is None and not res.kept_default
    assert family_assignment(res.chosen, "attention") == target

"""The tuner's confirmation and time budget (detent/tune.py `confirmed`, docs/tune.md steps 7
and 8) on the tiny Llama: the search's winner is measured again against the default on a
second cost model and written only when it beats the default by more than the default's own
drift; a deadline sizes that confirmation, skips it when too little fits, and a spent budget
keeps the default without searching."""
from __future__ import annotations

import time

import pytest

from detent.selection import CommitmentTuple, default_tuple
from detent.selection.compiler.tune_space import family_assignment, family_space, with_family
from detent.tune import CONFIRM_PROBE, confirmed, tune
from detent.tune_engine import engine_facts
from detent.tune_search import TuneResult
from tune_helpers import FakeCost, tiny_llm, workload

llm = pytest.fixture(scope="module")(tiny_llm)


class Confirm:
    """A second cost model for the confirmation: the default costs 10 (then 10 + `drift` on its
    later runs), every other tuple `tuned`."""

    def __init__(self, base_hash: str, tuned: float, drift: float = 0.0):
        self.base_hash, self.tuned, self.drift, self.seen = base_hash, tuned, drift, []

    def measure(self, t: CommitmentTuple, fraction: float) -> float:
        self.seen.append((t.hash == self.base_hash, fraction))
        if t.hash != self.base_hash:
            return self.tuned
        return 10.0 + (self.drift if len(self.seen) > 2 else 0.0)


@pytest.mark.parametrize("tuned, drift, keeps_default", [(12.0, 0.0, True), (8.0, 0.0, False), (10.0, 0.0, True),
                                                         (9.5, 1.0, True), (8.5, 1.0, False), (9.5, -1.0, True)])
def test_the_winner_is_confirmed_against_the_default_on_a_second_cost_model(llm, tuned, drift, keeps_default):
    # the search (a fake cost) picks BEST; the confirmation measures the default before and after
    # the winner on the whole workload and keeps the default unless the winner is cheaper than the
    # default's cheaper run by more than the default drifted between its runs (9.5 against 10 and 11,
    # or 10 and 9, is within that noise)
    facts = engine_facts(llm)
    base = default_tuple(facts)
    fake = FakeCost(facts)  # its default: the default tuple's assignments
    check = Confirm(base.hash, tuned, drift)
    out = tune(llm, workload(), cost=lambda inst, calls: fake, confirm=lambda inst, calls: check,
               max_candidates=64, refine=0, interactions=0, confirm_candidates=1)
    res = out.result
    assert check.seen == [(True, 1.0), (True, 1.0), (False, 1.0), (True, 1.0)]  # untimed, default, tuned, default
    assert res.confirmed == {"unit": "cost", "fraction": 1.0, "default": 10.0 + drift / 2,
                             "default_first_last": [10.0, 10.0 + drift], "margin": abs(drift),
                             "tuned": tuned, "kept_default": keeps_default}
    assert res.kept_default is keeps_default
    assert (res.chosen.hash == base.hash) is keeps_default
    if not keeps_default:  # the search's combined winner
        assert all(family_assignment(res.chosen, f) == r.chosen for f, r in res.families.items())


class Refutes:
    """A confirmation cost that refutes the first tuple other than the default it is given (the
    search's winner comes first): 12, against the default's 10 and 8 for any other tuple."""

    def __init__(self, base_hash: str):
        self.base_hash, self.seen = base_hash, []

    def measure(self, t: CommitmentTuple, fraction: float) -> float:
        self.seen.append(t)
        if t.hash == self.base_hash:
            return 10.0
        return 12.0 if t.hash == next(x.hash for x in self.seen if x.hash != self.base_hash) else 8.0


@pytest.mark.parametrize("candidates", [1, 2, 3])
def test_a_runner_up_is_taken_when_the_engine_refutes_the_searchs_winner(llm, candidates):
    # the search's cost model (fake) and the engine disagree about its winner, as lease 28's W-C kernel
    # search and engine did about FlashAttention-4. With one candidate the default stays; with more, the
    # search's cheapest runners-up (measured under the default's cost, other selections) are measured
    # between the default's two runs, and the cheapest of them is taken
    facts = engine_facts(llm)
    base = default_tuple(facts)
    fake = FakeCost(facts)
    check = Refutes(base.hash)
    out = tune(llm, workload(), cost=lambda inst, calls: fake, confirm=lambda inst, calls: check,
               max_candidates=64, refine=0, interactions=0, confirm_candidates=candidates)
    res = out.result
    winner = check.seen[2]
    assert all(family_assignment(winner, f) == r.chosen for f, r in res.families.items())  # the search's pick
    alternates = res.alternates
    hashes = [t.hash for t in alternates]
    assert len(hashes) >= 2 and len(set(hashes)) == len(hashes) and not {base.hash, winner.hash} & set(hashes)
    search_cost = [100.0 + sum(fake.family_cost(f, family_assignment(t, f)) for f in res.families)
                   for t in alternates]
    assert search_cost == sorted(search_cost) and search_cost[-1] < res.base_cost  # cheapest first, under it
    assert [t.hash for t in check.seen] == [base.hash, base.hash, winner.hash, *hashes[:candidates - 1], base.hash]
    c = res.confirmed
    if candidates == 1:
        assert res.kept_default and res.chosen.hash == base.hash and c["tuned"] == 12.0 and "taken" not in c
    else:
        assert not res.kept_default and res.chosen.hash == hashes[0] and c["taken"] == 1 and c["tuned"] == 8.0
        assert [x["cost"] for x in c["candidates"]] == [12.0] + [8.0] * (candidates - 1)
        assert res.pick == "combined best"  # the search's own pick, as its report names it


class Clocked:
    """A confirmation cost on a fake clock: a run of share f takes `install` (when the tuple
    changes; `new_install` for a tuple other than the default, whose kernels compile then) +
    f * `run` seconds; the default costs 10, any other tuple 8."""

    unit = "cost"

    def __init__(self, base_hash: str, run: float, install: float, new_install: float | None = None):
        self.base_hash, self.run, self.install, self.now, self.held = base_hash, run, install, 0.0, None
        self.new_install = install if new_install is None else new_install
        self.seen, self.last_install_s, self.max_install_s = [], 0.0, install

    def measure(self, t: CommitmentTuple, fraction: float) -> float:
        self.last_install_s = (0.0 if t.hash == self.held else self.install if t.hash == self.base_hash
                               else self.new_install)
        self.max_install_s = max(self.max_install_s, self.last_install_s)
        self.held = t.hash
        self.now += self.last_install_s + fraction * self.run
        self.seen.append((t.hash == self.base_hash, fraction))
        return 10.0 if t.hash == self.base_hash else 8.0


@pytest.mark.parametrize("left, fraction", [(400.0, 1.0), (171.0, 0.5), (35.0, None)])
def test_a_deadline_sizes_the_confirmation_and_skips_it_when_too_little_fits(llm, left, fraction):
    # a whole run takes 100 s and a tuple switch 10: the untimed probe (a quarter, after a switch)
    # tells the run's length; the three timed runs and two switches must end before the deadline
    facts = engine_facts(llm)
    base = default_tuple(facts)
    space = family_space(facts, "gemm")
    other = next(a for a in space.legal if a != family_assignment(base, "gemm"))
    winner = with_family(base, space, other)
    m = Clocked(base.hash, run=100.0, install=10.0)
    res = confirmed(TuneResult(10.0, {}, [], winner, False), base, m, lambda s: None,
                    deadline=CONFIRM_PROBE * 100.0 + 10.0 + left, clock=lambda: m.now)
    if fraction is None:  # 35 s cannot hold three runs of a tenth (30 s) and two switches (20 s)
        assert m.seen == [(True, CONFIRM_PROBE)]
        assert res.confirmed["skipped"] and res.confirmed["fraction"] == 0.0
        assert res.kept_default and res.chosen.hash == base.hash  # an unconfirmed winner is not written
    else:
        assert m.seen == [(True, CONFIRM_PROBE), (True, fraction), (False, fraction), (True, fraction)]
        assert res.confirmed["fraction"] == fraction and not res.kept_default and res.chosen.hash == winner.hash
        assert m.now <= CONFIRM_PROBE * 100.0 + 10.0 + left


@pytest.mark.parametrize("left, measured, fraction", [(455.0, 2, 1.0), (85.0, 2, 0.13), (55.0, 1, 0.11)])
def test_a_deadline_drops_runners_up_before_it_shrinks_the_share_below_a_tenth(llm, left, measured, fraction):
    # a whole run 100 s, a switch 10 s. The winner and one runner-up take four timed runs and three
    # switches: 55 s holds them only at 6% of the workload, so the runner-up is dropped and the winner
    # alone runs on 11%; 85 s holds both at 13%; 455 s both on the whole workload
    facts = engine_facts(llm)
    base = default_tuple(facts)
    space = family_space(facts, "attention")
    winner, runner = [with_family(base, space, a) for a in space.legal if a != family_assignment(base, "attention")][:2]
    m = Clocked(base.hash, run=100.0, install=10.0)
    res = confirmed(TuneResult(10.0, {}, [], winner, False, alternates=[runner]), base, m, lambda s: None,
                    deadline=CONFIRM_PROBE * 100.0 + 10.0 + left, clock=lambda: m.now, candidates=2)
    assert m.seen[1:] == [(True, fraction)] + [(False, fraction)] * measured + [(True, fraction)] and res.confirmed["fraction"] == fraction and not res.kept_default
    assert m.now <= CONFIRM_PROBE * 100.0 + 10.0 + left


def test_a_runner_up_is_dropped_when_the_winners_install_leaves_no_time_for_it(llm):
    # a whole run 100 s; the default installs in 10 s, a tuple whose kernels are new in 25. Sized
    # at the default's install, 85 s holds the winner and a runner-up at 13% of the workload; after
    # the winner's slower install, the runner-up and the default's last run (2 x (13 + 25) s) no
    # longer fit the 34 s left, so the runner-up is not measured and the deadline holds (measured
    # anyway, it ended 27 s past it: lease 33's tune ended 12 s past its own)
    facts = engine_facts(llm)
    base = default_tuple(facts)
    space = family_space(facts, "attention")
    winner, runner = [with_family(base, space, a) for a in space.legal if a != family_assignment(base, "attention")][:2]
    m = Clocked(base.hash, run=100.0, install=10.0, new_install=25.0)
    said = []
    deadline = CONFIRM_PROBE * 100.0 + 10.0 + 85.0
    res = confirmed(TuneResult(10.0, {}, [], winner, False, alternates=[runner]), base, m, said.append,
                    deadline=deadline, clock=lambda: m.now, candidates=2)
    assert m.seen[1:] == [(True, 0.13), (False, 0.13), (True, 0.13)]
    assert m.now <= deadline and res.chosen.hash == winner.hash and "candidates" not in res.confirmed
    assert any("measured the tuned tuple" in line for line in said), said


def test_kernel_cost_search_confirmed_on_the_engine(llm):
    out = tune(llm, workload(), cost="kernels", confirm="engine", families=["gemm"], max_candidates=2,
               min_fraction=1.0, refine=0, interactions=0)
    c = out.result.confirmed
    # the search took the default tuple: nothing to confirm. The family's own winner may differ from
    # its default while the whole-workload measurement still took the default tuple (a fresh clone's
    # run, 2026-12-06: the family chose another chunk, the tuple stayed the default, nothing confirmed)
    if out.result.pick == "default":
        assert c is None
    else:
        # over the closed loops W-A's loads run in (their number depends on the engine's clock)
        assert c["unit"].startswith("ms per output token, row-weighted step time") and c["default"] > 0 \
            and c["tuned"] > 0
        assert out.result.kept_default is c["kept_default"]


def test_a_spent_time_budget_keeps_the_default_without_searching(llm):
    # the deadline already passed when the search begins: the default is measured (every comparison's
    # base), no candidate is, and the default tuple is the answer
    facts = engine_facts(llm)
    base = default_tuple(facts)
    fake = FakeCost(facts)  # its default: the default tuple's assignments
    out = tune(llm, workload(), cost=lambda inst, calls: fake, deadline=time.perf_counter(), max_candidates=4)
    res = out.result
    assert res.cut and res.kept_default and res.chosen.hash == base.hash and res.checks == []
    assert [t.hash for t in fake.seen] == [base.hash, base.hash]
    assert set(out.phases) == {"loops", "profile", "search"}

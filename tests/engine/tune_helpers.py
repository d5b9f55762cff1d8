"""Shared by the tuner's tests (test_tune.py, test_tune_confirm.py): the tiny Llama they
tune, a small W-A, and a fake cost model whose optimum is known."""
from __future__ import annotations

from detent.selection import CommitmentTuple, default_tuple
from detent.selection.compiler.tune_space import family_assignment
from detent.tune import tune
from detent.tune_engine import closed_loops, engine_facts
from detent.workloads import make
from engine_helpers import bundle, make_llm

CONFIG = dict(max_num_batched_tokens=32, max_model_len=512)  # the battery's deployment: tune for the same facts
BEST = {"attention": {"split_tokens": 32, "split_stride": 64}, "gemm": {"chunk": 1}}


class FakeCost:
    """Cost = per-family bowls around BEST (plus `interaction` when both families move from the
    default tuple of `facts`, or `interaction(assignments)` when it is a function);
    it checks every tuple it is given with the tuple loader and keeps them."""

    def __init__(self, facts, interaction: float = 0.0, check: bool = True):
        self.facts, self.interaction, self.check, self.seen = facts, interaction, check, []
        self.default = {f: family_assignment(default_tuple(facts), f) for f in ("gemm", "attention")}

    def family_cost(self, family: str, a: dict) -> float:
        if family == "gemm":
            return {1: 0.0, 16: 5.0}[a["chunk"]]
        return abs(a["split_tokens"] - 32) / 16 + {16: 3.0, 64: 0.0, 256: 1.0, 1024: 2.0}[a["split_stride"]]

    def measure(self, t: CommitmentTuple, fraction: float) -> float:
        if self.check:
            CommitmentTuple.from_json(t.to_json()).validate(self.facts)  # raises TupleError on an illegal tuple
        self.seen.append(t)
        a = {f: family_assignment(t, f) for f in ("gemm", "attention")}
        moved = all(a[f] != self.default[f] for f in a)
        extra = self.interaction(a) if callable(self.interaction) else self.interaction if moved else 0.0
        return 100.0 + sum(self.family_cost(f, x) for f, x in a.items()) + extra


def tiny_llm():
    """The body of each module's `llm` fixture (module scope)."""
    llm = make_llm(bundle("llama"), "pinned", **CONFIG)
    yield llm
    llm.shutdown()


def workload():
    return make("W-A", num_requests=5, max_len=96, vocab=160)


def fake_tune(llm, interaction=0.0, check=True, **search):
    """`tune` with a FakeCost: (its output, the cost model). The workload replays as one batch
    (`loops`): the loads' closed loops are measured on the engine's clock (`load_loops`), and these
    tests' profiles must not depend on it."""
    fake = FakeCost(engine_facts(llm), interaction, check)
    w = workload()
    out = tune(llm, w, cost=lambda inst, calls: fake, loops=search.pop("loops", closed_loops(w)), **search)
    return out, fake

"""The tuner's objective (docs/tune.md, "Objective") on the tiny Llama (fp32, CPU).

Under "tpot" a profiled step's calls weigh its decode rows (times the steps it stands for), so
a prefill-only step weighs 0; under "time" every step weighs the steps it stands for. A per-call
cost that makes one gemm assignment cheaper on prompt calls and dearer on decode calls is
minimized by that assignment under "time" and by the other under "tpot". The engine's decode-row
counters are filled on CPU, and the engine cost reads them."""
from __future__ import annotations

import contextlib
import math
import tempfile

import pytest

from detent.engine import STEP_KIND_FIELDS
from detent.selection import default_tuple
from detent.selection.compiler.tune_space import family_assignment
from detent.tune import tune
from detent.tune_cost import LAUNCH, ROW_SECONDS, ROWS, STEPS, EngineCost, profile_workload, row_weighted_ms
from detent.tune_engine import TupleInstaller, engine_facts, run_offline
from detent.tune_kernels import KernelCost
from detent.workloads import Load, Request, Workload
from tune_helpers import tiny_llm, workload

llm = pytest.fixture(scope="module")(tiny_llm)


@contextlib.contextmanager
def _admissions(llm):
    """(the scheduler's request limit, its running requests) after each schedule call inside."""
    sched = llm.llm_engine.scheduler
    widths, real = [], sched.schedule

    def schedule(*a, **k):
        out = real(*a, **k)
        widths.append((sched.limits.max_num_seqs, len(sched.running)))
        return out
    sched.schedule = schedule
    try:
        yield widths
    finally:
        del sched.schedule


def _profile_steps(llm, objective: str, every: int):
    """Profile `workload()` under the default tuple: the calls, the profile's stats, and per step
    (query lengths, attention runtime key, the weight its calls were recorded with, or None when
    it replayed unrecorded)."""
    runner = llm.llm_engine.runner
    base = default_tuple(engine_facts(llm))
    forward, held_eager, held_graphs = runner._forward, getattr(runner, "_eager_forward", None), \
        getattr(runner, "graphs_tuple", None)
    steps = []

    def key(ctx):
        return tuple(sorted(ctx.runtime(ctx.attn.num_tokens).items()))

    def eager(input_ids, positions, ctx):
        steps.append((ctx.attn.query_lens_cpu, key(ctx), runner.dispatcher.record_weight))
        return forward(input_ids, positions, ctx)

    def graphs(input_ids, positions, ctx):  # a stand-in for the decode graphs: not recorded
        steps.append((ctx.attn.query_lens_cpu, key(ctx), None))
        return forward(input_ids, positions, ctx)
    runner._forward, runner._eager_forward = graphs, eager
    runner.graphs_tuple = base.hash  # the graphs hold the profiled tuple's selections: decode steps sampled
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inst = TupleInstaller(llm, tmp, every, objective=objective)
            calls = profile_workload(inst, base, workload())
    finally:
        runner._forward, runner.graphs_tuple = forward, held_graphs
        if held_eager is None:
            del runner._eager_forward
        else:
            runner._eager_forward = held_eager
    return calls, inst.profile_stats, steps


@pytest.mark.parametrize("objective", ["tpot", "time"])
def test_a_steps_calls_weigh_its_decode_rows_under_tpot_and_one_step_under_time(llm, objective):
    calls, stats, steps = _profile_steps(llm, objective, every=2)
    kinds = set()
    expected: dict = {}
    for qlens, rt, weight in steps:
        rows = sum(q == 1 for q in qlens)
        kind = "decode" if rows == len(qlens) else "prefill" if rows == 0 else "mixed"
        kinds.add((kind, rows > 1))
        if weight is None:
            assert kind == "decode"  # only decode-only steps replay
            continue
        steps_for = 2 if kind == "decode" else 1  # one decode-only step in 2 recorded, counted twice
        assert weight == (steps_for * rows if objective == "tpot" else steps_for), (qlens, weight)
        expected[rt] = expected.get(rt, 0) + weight
    assert {("decode", True), ("mixed", False), ("prefill", False)} <= kinds  # every kind of step was seen
    assert any(w is None for *_, w in steps)  # and some decode steps replayed unrecorded
    # the attention call site is called once per step (memoized): its weights are the steps' own
    att = {rt: n for (fam, _, rt), n in calls.items() if fam == "attention"}
    assert att == expected
    if objective == "tpot":
        assert any(n == 0 for n in att.values())  # inputs only prefill-only steps made
    assert stats["decode_rows"] == sum(sum(q == 1 for q in qlens) for qlens, _, _ in steps)


class PromptOrDecode:
    """A per-call cost: each profiled gemm call, times its weight, priced by the tuple's gemm
    `chunk` and whether the call's step has prompt rows (max_seqlen_q > 1). chunk 16 (the
    default) is the cheaper on prompt calls, chunk 1 on decode calls."""

    PRICE = {16: {"prompt": 1.0, "decode": 3.0}, 1: {"prompt": 10.0, "decode": 2.0}}

    def __init__(self, calls):
        self.calls = calls

    def measure(self, t, fraction: float) -> float:
        price = self.PRICE[family_assignment(t, "gemm")["chunk"]]
        return sum(n * price["decode" if dict(rt)["max_seqlen_q"] == 1 else "prompt"]
                   for (fam, _, rt), n in self.calls.items() if fam == "gemm")


def _sequential() -> Workload:
    """Two requests one after the other: 96-token prompts (three 32-token chunks, the last
    sampling the first token) and 3 output tokens, so prefill-only steps and one-row decode steps."""
    first = tuple(2 + (7 * i) % 150 for i in range(96))
    second = tuple(2 + (11 * i + 5) % 150 for i in range(96))
    return Workload("sequential", (Request(first, 3), Request(second, 3, after=0)), (Load("all", concurrency=1),), 0)


@pytest.mark.parametrize("objective, chunk", [("time", 16), ("tpot", 1)])
def test_time_takes_the_prompt_cheap_assignment_and_tpot_the_decode_cheap_one(llm, objective, chunk):
    # time: 6 prompt-chunk steps at 1 against 10, a sampled decode step (counted 8) at 3 against 2;
    # tpot: the prompt chunks weigh 0 (prefill-only), the decode rows alone decide
    out = tune(llm, _sequential(), cost=lambda inst, calls: PromptOrDecode(calls), objective=objective,
               families=["gemm"], max_candidates=2, min_fraction=1.0, refine=0, interactions=0)
    assert out.objective == objective
    assert out.result.families["gemm"].chosen == {"chunk": chunk}
    assert family_assignment(out.result.chosen, "gemm") == {"chunk": chunk}
    assert out.result.kept_default is (chunk == 16)


def _snapshot(**kinds):
    out = {k: [0.0] * len(STEP_KIND_FIELDS) for k in ("decode", "mixed", "prefill")}
    for kind, fields in kinds.items():
        for i, v in fields.items():
            out[kind][i] = v
    return {k: tuple(v) for k, v in out.items()}


def test_row_weighted_ms_from_the_step_kind_counters():
    before = _snapshot(decode={STEPS: 1, LAUNCH: 0.5, ROWS: 3, ROW_SECONDS: 0.9})
    after = _snapshot(decode={STEPS: 5, LAUNCH: 0.54, ROWS: 13, ROW_SECONDS: 0.95},
                      mixed={STEPS: 2, LAUNCH: 0.06, ROWS: 2, ROW_SECONDS: 0.004},
                      prefill={STEPS: 3, LAUNCH: 0.3})
    # 10 + 2 rows; 0.05 + 0.004 row-seconds; with the launch, + 0.04 / 4 * 10 + 0.06 / 2 * 2
    assert row_weighted_ms(before, after, add_launch=False) == pytest.approx(1e3 * 0.054 / 12)
    assert row_weighted_ms(before, after, add_launch=True) == pytest.approx(1e3 * (0.054 + 0.1 + 0.06) / 12)
    with pytest.raises(ValueError, match="no decode rows.*--objective time"):
        row_weighted_ms(before, before, add_launch=True)


def test_the_engine_counts_decode_rows_on_cpu_and_the_engine_cost_reads_them(llm):
    eng, w = llm.llm_engine, workload()
    before = eng.stats()["steps_by_kind"]
    _, tokens = run_offline(llm, w)
    after = eng.stats()["steps_by_kind"]
    d = {k: [a - b for a, b in zip(after[k], before[k])] for k in after}
    rows = sum(v[ROWS] for v in d.values())
    # every token after a request's first, and a prompt's one-token last chunk (a prefix-cache hit)
    assert tokens - len(w.requests) <= rows < tokens and d["prefill"][ROWS] == 0
    assert sum(v[ROW_SECONDS] for v in d.values()) > 0
    # a synchronous step loop (CPU): the engine times a step from its launch's return, so the launch
    # (here the whole forward) is outside the step seconds and row_weighted_ms must add it
    seconds = STEP_KIND_FIELDS.index("seconds")
    assert not eng.async_scheduling and sum(v[seconds] for v in d.values()) < sum(v[LAUNCH] for v in d.values())
    assert row_weighted_ms(before, after, add_launch=True) > row_weighted_ms(before, after, add_launch=False)
    with tempfile.TemporaryDirectory() as tmp:
        inst = TupleInstaller(llm, tmp)
        cost = EngineCost(inst, w, objective="tpot")
        assert cost.unit == "ms per output token, row-weighted step time"
        assert cost.measure(default_tuple(engine_facts(llm)), 1.0) > 0
    with pytest.raises(ValueError, match="objective 'speed'"):
        EngineCost(inst, w, objective="speed")


def test_kernel_cost_per_decode_row(llm, monkeypatch, tmp_path):
    # each call timed at 1 ms: the cost is the sum of the kept weights, or that over the decode rows
    monkeypatch.setattr(KernelCost, "_time", lambda self, call: 1e-3)
    calls, stats, _ = _profile_steps(llm, "tpot", every=1)
    facts, base = engine_facts(llm), default_tuple(engine_facts(llm))
    weighed = sum(n for (fam, _, _), n in calls.items() if fam in ("gemm", "attention"))
    total = KernelCost(calls, facts, str(tmp_path), families=("gemm", "attention"), max_inputs=10 ** 6)
    assert all(n > 0 for _, n in total.inputs)  # a prefill-only step's inputs are not timed
    assert total.measure(base, 1.0) == pytest.approx(weighed)
    per_row = KernelCost(calls, facts, str(tmp_path), families=("gemm", "attention"), max_inputs=10 ** 6,
                         decode_rows=stats["decode_rows"])
    assert per_row.unit == "ms of kernel time per decode row (a TPOT estimate)"
    assert per_row.measure(base, 1.0) == pytest.approx(weighed / stats["decode_rows"])


def test_cli_objective_time_is_recorded_in_the_report(tmp_path):
    import json

    from detent.cli import main
    from detent.models.tiny import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    out = tmp_path / "t.json"
    assert main(["tune", "--model", model, "--workload", "W-C", "--num-requests", "2", "--max-len", "40",
                 "--families", "gemm", "--interactions", "0", "--refine", "0", "--objective", "time",
                 "--cost", "kernels", "--confirm", "none", "--device", "cpu", "--dtype", "float32",
                 "--max-model-len", "256", "--max-num-batched-tokens", "32", "-o", str(out)]) == 0
    rep = json.loads((tmp_path / "t.report.json").read_text())
    assert rep["objective"] == "time" and rep["unit"] == "ms of kernel time over the profiled calls"
    # the kernel cost's most weighed buckets, with the default's and the pick's time in each
    b = rep["kernel_buckets"]
    assert b and all(x["family"] == "gemm" and len(x["us"]) == 2 and all(u > 0 for u in x["us"]) for x in b)
    assert [x["weight"] for x in b] == sorted((x["weight"] for x in b), reverse=True)


def test_a_closed_loop_load_replays_with_that_many_requests_running(llm):
    """W-C's loads are closed loops (1 and 8 in flight): the replay runs the workload once per
    load with the engine admitting at most that many requests, so the profile decodes in the
    batches the load does. Four requests at 1 and at 2 in flight: no step holds more rows than its
    load, both loads' outputs count, and the engine's own limit is back after."""
    reqs = tuple(Request(tuple(2 + (5 * i + k) % 150 for i in range(20)), 4) for k in range(4))
    w = Workload("closed", reqs, (Load("C1", concurrency=1), Load("C2", concurrency=2)), 0)
    limits = llm.llm_engine.scheduler.limits
    with _admissions(llm) as widths:
        _, tokens = run_offline(llm, w)
    assert tokens == 2 * 4 * 4
    assert {cap for cap, _ in widths} == {1, 2}
    assert all(n <= cap for cap, n in widths) and max(n for cap, n in widths if cap == 2) == 2
    assert llm.llm_engine.scheduler.limits is limits


def test_the_engine_cost_of_closed_loops_is_the_geometric_mean_over_the_loops(llm, monkeypatch):
    """Under "tpot" each closed loop is replayed and timed on its own, and the cost is the geometric
    mean of their row-weighted step times, as the arms' report compares tuples (lease 27: FA4's
    +2.8 ms a token at 1 in flight and -2.6 at 8 was even pooled over the rows, 1.14 times the
    default per load). Stand-in loop times 4 and 16 ms: the cost is 8, where pooling the rows
    would give their row-weighted mean."""
    import detent.tune_cost as tc
    reqs = tuple(Request(tuple(2 + (5 * i + k) % 150 for i in range(20)), 4) for k in range(4))
    w = Workload("closed", reqs, (Load("C1", concurrency=1), Load("C2", concurrency=2)), 0)
    replays, times = [], iter([4.0, 16.0])
    real = tc.run_offline

    def run(llm_, w_, max_tokens_cap=None, caps=None):
        replays.append((caps, max_tokens_cap))
        return real(llm_, w_, max_tokens_cap, caps)
    monkeypatch.setattr(tc, "run_offline", run)
    monkeypatch.setattr(tc, "row_weighted_ms", lambda before, after, add_launch: next(times))
    with tempfile.TemporaryDirectory() as tmp:
        cost = EngineCost(TupleInstaller(llm, tmp), w, objective="tpot")
        assert cost.unit == "ms per output token, row-weighted step time, geometric mean over the closed loops of 1, 2"
        assert cost.measure(default_tuple(engine_facts(llm)), 1.0) == pytest.approx(8.0)
    assert replays == [(None, 2), ([1], None), ([2], None)]  # the warm-up replays both loops, untimed
    # a workload of Poisson loads (or one loop) is one replay, as before
    one = Workload("open", reqs, (Load("A1", fraction=0.5),), 0)
    with tempfile.TemporaryDirectory() as tmp:
        assert EngineCost(TupleInstaller(llm, tmp), one).unit == "ms per output token, row-weighted step time"


def test_the_profile_splits_by_closed_loop_and_the_kernel_cost_takes_their_geometric_mean(llm, monkeypatch,
                                                                                           tmp_path):
    # each loop's calls and decode rows add up to the whole profile's; with a call timed at 1 ms a
    # token (of its bucket), a loop's kernel cost per decode row is its token-weighted calls over
    # its rows, and the cost their geometric mean
    import detent.tune_kernels as tk
    monkeypatch.setattr(tk, "_call", lambda family, site, rt, fn, kw, device: lambda: rt["num_tokens"])
    monkeypatch.setattr(KernelCost, "_time", lambda self, call: 1e-3 * call())
    reqs = tuple(Request(tuple(2 + (5 * i + k) % 150 for i in range(20)), 4) for k in range(4))
    w = Workload("closed", reqs, (Load("C1", concurrency=1), Load("C2", concurrency=2)), 0)
    facts, base = engine_facts(llm), default_tuple(engine_facts(llm))
    inst = TupleInstaller(llm, str(tmp_path), objective="tpot")
    calls = profile_workload(inst, base, w)
    loops = inst.profile_loops
    assert [loop.cap for loop, _, _ in loops] == [1, 2]
    assert sum(rows for _, _, rows in loops) == inst.profile_stats["decode_rows"]
    for key, n in calls.items():
        assert sum(c.get(key, 0) for _, c, _ in loops) == n
    fams = ("gemm", "attention")
    per_loop = [sum(n * dict(tk.bucket(rt))["num_tokens"] for (f, _, rt), n in c.items() if f in fams) / rows
                for _, c, rows in loops]
    cost = KernelCost(calls, facts, str(tmp_path), families=fams, max_inputs=10 ** 6,
                      decode_rows=inst.profile_stats["decode_rows"], loops=loops)
    assert cost.unit == "ms of kernel time per decode row (a TPOT estimate), geometric mean over the closed loops of 1, 2"
    assert cost.measure(base, 1.0) == pytest.approx(math.sqrt(per_loop[0] * per_loop[1]))
    assert per_loop[0] != pytest.approx(per_loop[1])  # the loops differ: pooled would be another number


def test_a_load_runs_in_the_closed_loop_whose_throughput_is_its_rate():
    """Served (lease 29, one H100), the default ran 0.78, 2.21 and 5.26 W-B requests in flight at
    0.33, 0.67 and 1.0 of the maximum throughput; a closed loop of 1 ran 1.29 requests/s and of 8,
    3.13 (W-C). The concurrency where the loops' throughput reaches a rate: linear between the
    measured loops and from (0, 0), rounded, at least 1, and None above every loop."""
    from detent.tune_engine import concurrency_at
    rungs = [(1, 1.29), (2, 2.2), (4, 2.8), (8, 3.13)]
    assert [concurrency_at(rungs, r) for r in (0.2, 0.99, 2.0, 3.0, 3.2)] == [1, 1, 2, 6, None]
    assert concurrency_at([], 1.0) is None
    assert concurrency_at([(1, 1.0), (2, 1.0)], 1.0) == 1  # flat: the first that reaches it


def test_poisson_loads_are_measured_as_the_closed_loops_of_their_rates(monkeypatch):
    """A Poisson load runs at a fraction of the workload's maximum throughput, and how many
    requests it runs at once sets the batches its tokens decode in (FA4 was 9.5% cheaper on W-B in
    one batch of every request and 1.10 times the default served, lease 29). `load_loops` replays
    the workload with every request at once, then in closed loops of 1, 2, 4 until one reaches the
    highest load's rate, each loop on its head (`loop_requests`: 8 per request in flight, at least
    16), and maps each load to the loop of its rate. The replays are stand-ins with known
    throughputs: all at once 4 requests/s; loops of 1, 2, 4: 1.5, 2.8, 4.5."""
    import detent.tune_engine as te
    throughput = {None: 4.0, 1: 1.5, 2: 2.8, 4: 4.5, 8: 5.0}
    runs = []

    def replay(llm_, w, max_tokens_cap=None, caps=None):
        (cap,) = caps
        runs.append((len(w.requests), cap))
        return len(w.requests) / throughput[cap], 0
    monkeypatch.setattr(te, "run_offline", replay)
    reqs = tuple(Request((2 + k, 3, 4), 4) for k in range(40))
    w = Workload("open", reqs, (Load("B1", fraction=0.3), Load("B2", fraction=0.6), Load("B3", fraction=1.0)), 0)
    loops, found = te.load_loops(None, w)
    # rates 1.2, 2.4 and 4.0 requests/s: loops of 1 (0.8), 2 (1 + 0.9 / 1.3) and 3 (2 + 2 * 1.2 / 1.7)
    assert loops == [te.Loop(1, ("B1",), True), te.Loop(2, ("B2",), True), te.Loop(3, ("B3",), True)]
    assert runs == [(40, None), (16, 1), (16, 2), (32, 4)]  # the loop of 4 reached 4.0: no loop of 8
    assert found == {"max_throughput": 4.0, "max_throughput_from": "measured",
                     "throughput": {"1": 1.5, "2": 2.8, "4": 4.5}}
    # a given maximum (stock's, served) replaces the replay of every request at once: rates 0.75, 1.5
    # and 2.5 land on loops of 1 (0.5), 1 (1.0) and 2 (1 + 1.0 / 1.3 = 1.77)
    runs.clear()
    loops, found = te.load_loops(None, w, max_throughput=2.5)
    assert runs == [(16, 1), (16, 2)]  # the loop of 2 reached 2.5
    assert loops == [te.Loop(1, ("B1", "B2"), True), te.Loop(2, ("B3",), True)]
    assert found == {"max_throughput": 2.5, "max_throughput_from": "given", "throughput": {"1": 1.5, "2": 2.8}}
    assert [len(te.loop_requests(w, c).requests) for c in (1, 3, 8, None)] == [16, 24, 40, 40]
    # two loads in one loop weigh two; a rate above every loop's throughput runs every request at once;
    # a closed-loop load keeps its concurrency
    # the loops stop doubling where a doubling gains under 5% (the loop of 4: 3.6 after 3.5)
    throughput.update({1: 3.0, 2: 3.5, 4: 3.6, 8: 3.7, 16: 3.8, 32: 3.9})
    w2 = Workload("mixed", reqs, (Load("B1", fraction=0.3), Load("B2", fraction=0.6), Load("C1", concurrency=1),
                                  Load("B3", fraction=1.0)), 0)
    runs.clear()
    loops, _ = te.load_loops(None, w2)
    assert runs == [(40, None), (16, 1), (16, 2), (32, 4)]
    assert loops == [te.Loop(1, ("B1", "B2", "C1"), True), te.Loop(None, ("B3",), True)]
    assert [loop.weight for loop in loops] == [3, 1] and loops[0].label == "1 (B1, B2, C1)"
    # a workload no larger than a loop's head still gets every loop below its size (W-B tuned on its
    # first 16 documents: each loop replays all 16): rate 2.4 lands on 2 + 2 * 0.4 / 1.0 = 2.8
    # (rounded: 3); 4.0 is above the loop of 8, and a loop of 16 would be every request at once
    runs.clear()
    throughput.update({1: 1.0, 2: 2.0, 4: 3.0, 8: 3.5})
    assert te.load_loops(None, Workload("short", reqs[:16], (Load("B2", fraction=0.6),
                                                             Load("B3", fraction=1.0)), 0))[0] == [
        te.Loop(3, ("B2",), True), te.Loop(None, ("B3",), True)]
    assert runs == [(16, None), (16, 1), (16, 2), (16, 4), (16, 8)]
    # no Poisson load: the workload's closed loops, nothing replayed
    runs.clear()
    w3 = Workload("closed", reqs, (Load("C1", concurrency=1), Load("C2", concurrency=8)), 0)
    assert te.load_loops(None, w3) == ([te.Loop(1, ("C1",)), te.Loop(8, ("C2",))], {}) and runs == []


def test_a_poisson_loads_loop_is_profiled_and_timed_in_its_own_batches(llm, monkeypatch, tmp_path):
    """With the loops `load_loops` found, the profile replays each on its own with the engine
    admitting at most its cap (a loop of 1 decodes one row a step), and the engine cost weighs a
    loop once per load it stands for: stand-in loop times 4 and 16 ms, the loop of 4 standing
    for two loads, cost (4 * 4 * 16) ** (1/3)."""
    import detent.tune_cost as tc
    from detent.tune_engine import Loop
    reqs = tuple(Request(tuple(2 + (5 * i + k) % 150 for i in range(20)), 4) for k in range(4))
    w = Workload("open", reqs, (Load("B1", fraction=0.2), Load("B2", fraction=0.4), Load("B3", fraction=1.0)), 0)
    loops = [Loop(1, ("B1", "B2"), True), Loop(None, ("B3",), True)]
    with _admissions(llm) as widths:
        profile_workload(TupleInstaller(llm, str(tmp_path), objective="tpot"), default_tuple(engine_facts(llm)), w,
                         loops)
    one = [n for cap, n in widths if cap == 1]
    assert one and max(one) == 1 and max(n for _, n in widths) == 4  # the loop of 1, then all four at once
    times = iter([4.0, 16.0])
    monkeypatch.setattr(tc, "row_weighted_ms", lambda before, after, add_launch: next(times))
    cost = EngineCost(TupleInstaller(llm, str(tmp_path)), w, objective="tpot", loops=loops)
    assert cost.unit.endswith("geometric mean over the closed loops of 1 (B1, B2), all (B3)")
    assert cost.measure(default_tuple(engine_facts(llm)), 1.0) == pytest.approx((4 * 4 * 16) ** (1 / 3))

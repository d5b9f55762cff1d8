"""The engine's step accounting (engine/step_stats.py): the counters a fake step's launch and
collection add, the device time read from (stand-in) CUDA events, and the server's per-kind
series keyed by the engine's field names."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from detent.engine import HOST_PARTS, STEP_KIND_FIELDS, STEP_KINDS
from detent.engine.step_stats import KindCounters, StepStats, step_kind
from detent.server.metrics import STEP_KIND_COUNTERS, STEP_KIND_SERIES, Metrics


def _plan(*rows):
    """A plan of (tokens, samples) rows."""
    return SimpleNamespace(seqs=tuple(SimpleNamespace(num_tokens=n, sample=object() if s else None) for n, s in rows),
                           num_batched_tokens=sum(n for n, _ in rows))


def test_fields_are_unique_and_start_at_zero_in_the_tuples_order_and_types():
    assert len(set(STEP_KIND_FIELDS)) == len(STEP_KIND_FIELDS) == 14
    assert KindCounters().as_tuple() == (0, 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0, 0, 0.0, 0)
    assert [type(v) for v in KindCounters().as_tuple()] == [int, float, int, float, float, float, float, int, int,
                                                            float, float, int, float, int]
    c = KindCounters(*range(len(STEP_KIND_FIELDS)))  # a steps_by_kind tuple read back
    assert c.as_tuple() == tuple(range(len(STEP_KIND_FIELDS)))
    assert [getattr(c, f) for f in STEP_KIND_FIELDS] == list(range(len(STEP_KIND_FIELDS)))
    assert StepStats().as_dict() == {k: KindCounters().as_tuple() for k in STEP_KINDS}


def test_the_servers_series_are_keyed_by_the_engines_fields():
    assert set(STEP_KIND_SERIES) == set(STEP_KIND_FIELDS)
    assert STEP_KIND_COUNTERS == tuple(STEP_KIND_SERIES[f] for f in STEP_KIND_FIELDS)
    assert len({stem for stem, _ in STEP_KIND_COUNTERS}) == len(STEP_KIND_COUNTERS)
    # each field advances its own series: field i holds i + 1
    m = Metrics("m", 512)
    m.engine_stats({"steps_by_kind": {"mixed": tuple(range(1, len(STEP_KIND_FIELDS) + 1))}})
    for i, f in enumerate(STEP_KIND_FIELDS):
        stem = STEP_KIND_SERIES[f][0]
        assert m.registry.get_sample_value(f"detent:{stem}_total",
                                           {"model_name": "m", "engine": "0", "kind": "mixed"}) == i + 1, f
    # the stems the series carry (dashboards and benchmarks/serve_load.py read them)
    assert STEP_KIND_SERIES["steps"][0] == "engine_steps"
    assert STEP_KIND_SERIES["seconds"][0] == "engine_step_time_seconds"
    assert STEP_KIND_SERIES["launch_seconds"][0] == "engine_step_launch_seconds"
    assert STEP_KIND_SERIES["decode_row_seconds"][0] == "engine_step_decode_row_seconds"


def test_step_kind():
    assert step_kind(_plan((1, True), (1, False))) == "decode"
    assert step_kind(_plan((1, True), (7, True))) == "mixed"
    assert step_kind(_plan((7, True), (3, False))) == "prefill"


def test_a_steps_launch_and_collection_count_their_fields():
    stats = StepStats()
    plan = _plan((1, True), (1, False), (5, False))  # a decode row, a one-token chunk, a prompt chunk: mixed
    h = SimpleNamespace(plan=plan, launch_split=(0.1, 0.2), forward_path="whole_graph")
    t = time.perf_counter()
    stats.on_launch("mixed", h, t - 0.5, t, left_out=2)
    stats.add_launch_time(plan, 0.25)  # its deferred sampling
    stats.on_collect(h, 0.01, busy=True)
    c = stats.kinds["mixed"]
    assert (c.steps, c.tokens, c.decode_rows, c.rows_left_out) == (1, 7, 1, 2)
    assert (c.whole_graph_steps, c.piecewise_steps) == (1, 0)
    assert c.launch_seconds == pytest.approx(0.75) and (c.prepare_seconds, c.forward_seconds) == (0.1, 0.2)
    assert c.wait_seconds == 0.01 and 0 < c.seconds < 60 and c.decode_row_seconds == c.seconds  # one decode row
    assert (c.device_seconds, c.device_idle_seconds) == (0.0, 0.0)  # no CUDA events

    p = SimpleNamespace(plan=_plan((9, True)), forward_path="pieces")  # a runner without a launch split
    stats.on_launch("prefill", p, t, t + 0.125, left_out=0)
    stats.on_collect(p, 0.0, busy=False)
    d = stats.kinds["prefill"]
    assert (d.steps, d.tokens, d.decode_rows, d.piecewise_steps, d.prepare_seconds) == (1, 9, 0, 1, 0.0)
    assert d.launch_seconds == pytest.approx(0.125) and d.decode_row_seconds == 0.0
    assert stats.kinds["decode"] == KindCounters()
    assert stats.as_dict() == {k: v.as_tuple() for k, v in stats.kinds.items()}

    host = stats.host_time(dict.fromkeys(HOST_PARTS, 1.0))
    assert list(host) == list(HOST_PARTS)
    assert host["launch"] == c.launch_seconds + d.launch_seconds and host["wait"] == 0.01 and host["update"] == 1.0


def test_a_dropped_step_holds_no_launch_time():
    stats = StepStats()
    h = SimpleNamespace(plan=_plan((1, True)))
    stats.on_launch("decode", h, 0.0, 1.0, left_out=0)
    stats.drop(h)
    assert not stats._launched_at and stats.kinds["decode"].launch_seconds == 1.0


class _Event:
    """A stand-in for a CUDA timing event: a device time in seconds, completed or not."""

    def __init__(self, t: float, done: bool = True):
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "_Event") -> float:  # milliseconds, as torch.cuda.Event's
        return (other.t - self.t) * 1e3


def test_device_spans_and_idle_gaps_are_counted_in_order_once_their_events_complete():
    """device_seconds and device_idle_seconds (CUDA events; stand-ins here): a step's span, and
    the device's idle time before it, counted only after the step before left work; a step whose
    events have not completed waits for a later count, never for the device."""
    stats = StepStats()
    one = _plan((1, True))  # a decode
    kinds = stats.kinds["decode"]

    def count(t0, t1, done=True, busy=True):
        stats.on_collect(SimpleNamespace(plan=one, events=(_Event(t0), _Event(t1, done))), 0.0, busy)

    count(0.0, 0.010)  # span 10 ms; nothing before it
    count(0.012, 0.020, done=False)  # not complete: counted later
    assert (round(kinds.device_seconds, 6), round(kinds.device_idle_seconds, 6)) == (0.010, 0.0)
    stats._device_pending[0][2].done = True
    count(0.020, 0.025, busy=False)  # counts both: spans 8 + 5 ms, idle 2 ms before the second
    assert (round(kinds.device_seconds, 6), round(kinds.device_idle_seconds, 6)) == (0.023, 0.002)
    count(5.0, 5.004)  # the engine had no work after the last step: its 4.975 s gap is not idle time
    assert (round(kinds.device_seconds, 6), round(kinds.device_idle_seconds, 6)) == (0.027, 0.002)

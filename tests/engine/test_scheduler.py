"""Scheduler: token budget, chunked prefill, decodes first, preemption, abort."""
import pytest

from detent.sampling.params import SamplingParams
from detent.scheduler.outputs import ModelOutput, SampledToken
from detent.scheduler.request import Request, RequestStatus
from detent.scheduler.scheduler import Scheduler, SchedulerLimits

BS = 4


def make(num_blocks=32, seqs=8, budget=16, max_len=64, caching=True):
    return Scheduler(SchedulerLimits(seqs, budget, max_len), num_blocks, BS, caching)


def req(rid, n, max_tokens=8, first=10, **kw):
    return Request(rid, list(range(first, first + n)), SamplingParams(temperature=0, max_tokens=max_tokens, **kw),
                   seed=0, block_size=BS)


def run_step(s, tok=7):
    plan = s.schedule()
    out = ModelOutput({q.request_id: SampledToken(tok, (0.0, 1, (), ())) for q in plan.seqs if q.sample},
                      {q.request_id: tuple((0.0, 1, (), ()) for _ in q.prompt_targets)
                       for q in plan.seqs if q.prompt_targets})
    s.update(plan, out)
    return plan


def test_chunked_prefill_then_decode():
    s = make(budget=8)
    s.add(req("a", 20))
    chunks = [(q.start, q.num_tokens, q.sample is not None) for q in run_step(s).seqs]
    assert chunks == [(0, 8, False)]
    assert [(q.start, q.num_tokens) for q in run_step(s).seqs] == [(8, 8)]
    p = run_step(s)
    assert [(q.start, q.num_tokens) for q in p.seqs] == [(16, 4)] and p.seqs[0].sample.position == 20
    p = run_step(s)
    assert [(q.start, q.num_tokens, q.token_ids) for q in p.seqs] == [(20, 1, (7,))]
    assert p.seqs[0].sample.position == 21  # the index the new token will have


def test_decodes_first_and_budget():
    s = make(budget=8)
    s.add(req("a", 3))
    run_step(s)  # a prefilled, sampled
    s.add(req("b", 30))
    p = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 7)]
    assert p.num_batched_tokens == 8
    p = run_step(s)  # b continues its prefill after a's decode
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 7)]


def test_max_num_seqs():
    s = make(seqs=2, budget=64)
    for i in range(3):
        s.add(req(f"r{i}", 4, first=10 * i))
    assert [q.request_id for q in run_step(s).seqs] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_preemption_by_recompute_of_latest_admitted():
    # 6 usable blocks; two requests of 8 prompt tokens (2 blocks each) grow until the pool runs out
    s = make(num_blocks=7, budget=64, max_len=24)  # one max_model_len request fits (6 blocks)
    a, b = req("a", 8, max_tokens=20), req("b", 8, max_tokens=20, first=40)
    s.add(a), s.add(b)
    preempted = []
    for _ in range(12):
        p = run_step(s)
        preempted += p.preempted_ids
        if preempted:
            break
    assert preempted == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and s.waiting[0] is b
    assert b.num_output_tokens > 0  # outputs kept: it recomputes prompt + outputs
    # b resumes once a finishes, recomputing everything it had (prefix hits allowed)
    while b.status != RequestStatus.RUNNING:
        run_step(s)
    assert a.is_finished
    assert b.num_computed_tokens + 1 >= b.num_tokens


def test_preempted_victim_already_planned_gives_back_its_budget():
    s = make(num_blocks=4, budget=64, max_len=12)  # 3 usable blocks
    a, b = req("a", 4, max_tokens=8), req("b", 3, max_tokens=8, first=40)
    s.add(a), s.add(b)
    run_step(s)  # a: 4 tokens -> 1 block (+ sample), b: 1 block
    p = run_step(s)  # a needs a 2nd block (pos 4), b fits in its block
    for _ in range(6):
        p = run_step(s)
        if p.preempted_ids:
            break
    assert p.preempted_ids == ("b",)
    assert [q.request_id for q in p.seqs] == ["a"]
    assert p.num_batched_tokens == 1


def test_abort_frees_blocks():
    s = make()
    a = req("a", 10)
    s.add(a)
    run_step(s)
    assert s.bm.num_free_blocks == 31 - 3
    s.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and s.bm.num_free_blocks == 31
    assert not s.has_unfinished()


def test_a_plan_says_which_requests_finished_since_the_plan_run_before():
    """A runner that keeps state per request (a tensor-parallel rank keeps its sampling
    parameters) drops it by SchedulerOutput.finished_ids: every finish, once, in the next plan
    that has rows (an empty plan is not run), and again after a failed step is retracted."""
    s = make()
    s.add(req("a", 4, max_tokens=1))
    s.add(req("b", 4, max_tokens=9))
    s.add(req("c", 4))
    assert run_step(s).finished_ids == ()  # a's one token finishes it
    s.abort("c")
    plan = s.schedule()
    assert plan.finished_ids == ("a", "c") and [q.request_id for q in plan.seqs] == ["b"]
    s.retract(plan)
    assert run_step(s).finished_ids == ("a", "c")
    s.abort("b")
    assert s.schedule().finished_ids == ()  # nothing left to plan: the next plan says it
    s.add(req("d", 4))
    assert run_step(s).finished_ids == ("b",) and run_step(s).finished_ids == ()


def test_stops():
    s = make()
    a = req("a", 4, max_tokens=3)
    b = Request("b", [1, 2], SamplingParams(temperature=0, stop_token_ids=[7]), seed=0, block_size=BS)
    c = Request("c", [1, 2], SamplingParams(temperature=0, max_tokens=50), seed=0, block_size=BS,
                eos_token_ids=[7])
    d = Request("d", [1, 2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), seed=0,
                block_size=BS, eos_token_ids=[7])
    for r in (a, b, c, d):
        s.add(r)
    for _ in range(6):
        run_step(s)
    assert (a.status, a.num_output_tokens) == (RequestStatus.FINISHED_LENGTH, 3)
    assert (b.status, b.stop_reason, b.output_token_ids) == (RequestStatus.FINISHED_STOPPED, 7, [7])
    assert (c.status, c.stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    assert (d.status, d.num_output_tokens) == (RequestStatus.FINISHED_LENGTH, 5)


def test_max_model_len_ends_with_length():
    s = make(max_len=6)
    a = req("a", 4, max_tokens=None)
    s.add(a)
    for _ in range(5):
        run_step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 6


def test_prompt_logprob_rows_skip_cache_and_cover_prompt():
    s = make(budget=5)
    a = req("a", 12, prompt_logprobs=2)
    s.add(a)
    spans = []
    for _ in range(3):
        p = run_step(s)
        q = p.seqs[0]
        spans.append((q.prompt_rows_start, len(q.prompt_targets)))
    assert spans == [(0, 5), (5, 5), (10, 1)]  # rows 0..10 predict tokens 1..11
    assert len(a.prompt_logprobs) == 11


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerLimits(1, 0, 10)


def _out(plan, tok=7):
    return ModelOutput({q.request_id: SampledToken(tok, (0.0, 1, (), ())) for q in plan.seqs if q.sample},
                       {q.request_id: tuple((0.0, 1, (), ()) for _ in q.prompt_targets)
                        for q in plan.seqs if q.prompt_targets})


class HostGrammar:
    """A grammar that allows everything: it advances on the host, so under a scheduler
    without `grammar_after_launch` its request waits for each token."""
    ready, pending, error = True, False, None

    def accept(self, token_id):
        return True

    def is_terminated(self):
        return False

    def release(self):
        pass


def waits_for_tokens(rid, n, max_tokens=5):
    r = req(rid, n, max_tokens=max_tokens)
    r.grammar = HostGrammar()
    return r


def test_plans_ahead_with_placeholders_for_pending_tokens():
    """Async scheduling: the next plan is made before the previous step's tokens arrive."""
    from detent.scheduler.outputs import PLACEHOLDER
    s = make(budget=64)
    a, b = req("a", 5, max_tokens=3), req("b", 3, max_tokens=1)
    c = waits_for_tokens("c", 4)  # its grammar needs each token on the host: it waits
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    assert [(q.request_id, q.num_tokens, q.sample.position) for q in p1.seqs] == [("a", 5, 5), ("b", 3, 3),
                                                                                  ("c", 4, 4)]
    assert (a.num_computed_tokens, a.num_pending) == (5, 1)
    p2 = s.schedule()  # b's pending token is its last; c needs its step collected first
    assert [(q.request_id, q.start, q.token_ids, q.sample.position) for q in p2.seqs] == [
        ("a", 5, (PLACEHOLDER,), 6)]
    assert a.num_pending == 2
    s.update(p1, _out(p1, 8))
    assert a.output_token_ids == [8] and a.num_pending == 1 and b.is_finished and c.num_pending == 0
    p3 = s.schedule()
    assert [(q.request_id, q.start, q.token_ids) for q in p3.seqs] == [("a", 6, (PLACEHOLDER,)), ("c", 4, (8,))]
    s.update(p2, _out(p2, 9))
    s.update(p3, _out(p3, 10))
    assert a.output_token_ids == [8, 9, 10] and a.is_finished  # max_tokens=3
    assert c.output_token_ids == [8, 10] and not c.is_finished


def test_num_left_out_counts_the_generating_requests_a_plan_leaves_out():
    """What a step leaves out of the requests that could run: not a request whose pending token
    is its last, nor one that waits for its token on the host, nor one mid-prompt."""
    from detent.scheduler.outputs import SchedulerOutput
    s = make(budget=32, max_len=128)
    a, b = req("a", 5, max_tokens=3), req("b", 3, max_tokens=1)
    c = waits_for_tokens("c", 4)
    for r in (a, b, c):
        s.add(r)
    p1 = s.schedule()
    assert s.num_left_out(p1) == 0
    p2 = s.schedule()  # only a: b's pending token is its last, c waits for its step
    assert [q.request_id for q in p2.seqs] == ["a"] and s.num_left_out(p2) == 0
    empty = SchedulerOutput((), 0, ())
    assert s.num_left_out(empty) == 1  # a step without a leaves a out
    s.add(req("d", 40, first=30))
    s.update(p1, _out(p1))
    p3 = s.schedule()  # a's last token, c's first decode, and d's prompt cut to the budget left
    assert [(q.request_id, q.num_tokens) for q in p3.seqs] == [("a", 1), ("c", 1), ("d", 30)]
    assert s.num_left_out(p3) == 0 and s.num_left_out(empty) == 0  # a's last, c waits, d mid-prompt
    s.update(p2, _out(p2))
    s.update(p3, _out(p3))
    p4 = s.schedule()  # a finished; c decodes, d's prompt ends and samples
    assert [(q.request_id, q.num_tokens) for q in p4.seqs] == [("c", 1), ("d", 10)]
    assert s.num_left_out(p4) == 0 and s.num_left_out(SchedulerOutput(p4.seqs[:1], 1, ())) == 1
    assert s.num_left_out(empty) == 1  # d could run on its pending token; c waits for its own on the host


def test_a_request_that_reads_its_outputs_plans_ahead_with_its_pending_token_marked():
    """Penalties and golden tokens read the output so far: the row planned over a placeholder
    says its last token is pending, and the golden token is the one after it."""
    from detent.scheduler.outputs import PLACEHOLDER
    s = make(budget=64)
    g = req("g", 4, max_tokens=4, repetition_penalty=1.2, golden_token_ids=[20, 21, 22, 23])
    s.add(g)
    (q1,), (q2,) = s.schedule().seqs, s.schedule().seqs
    assert (q1.token_ids[-1], q1.sample.pending, q1.sample.golden_token) == (13, 0, 20)
    assert (q2.token_ids, q2.sample.pending, q2.sample.golden_token) == ((PLACEHOLDER,), 1, 21)


def test_a_preempted_request_with_a_pending_token_waits_for_it():
    s = make(budget=64)
    a = req("a", 5, max_tokens=8)
    s.add(a)
    p1 = s.schedule()
    s._preempt(a)
    assert a.num_pending == 1 and s.schedule().is_empty  # not re-admitted before its token arrives
    s.update(p1, _out(p1, 8))
    p2 = s.schedule()
    # recomputes prompt + the token (its first full block is a prefix-cache hit)
    assert [(q.request_id, q.start, q.token_ids) for q in p2.seqs] == [("a", 4, (14, 8))]


def test_the_scheduler_stops_on_a_stop_string_and_frees_the_blocks():
    seen = []

    def stop_strings(r):  # the output processor's role: "the text now holds this stop string"
        seen.append((r.request_id, r.num_output_tokens, r.status))
        return "END" if r.num_output_tokens == 2 else None
    s = Scheduler(SchedulerLimits(8, 16, 64), 32, BS, stop_strings=stop_strings)
    a, b = req("a", 5), req("b", 5, max_tokens=2)  # b's second token also reaches max_tokens
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)
    assert (a.status, a.stop_reason) == (RequestStatus.FINISHED_STOPPED, "END")
    assert (b.status, b.stop_reason) == (RequestStatus.FINISHED_STOPPED, "END")  # the string wins
    assert ("b", 2, RequestStatus.FINISHED_LENGTH) in seen  # asked after the length stop, to flush text
    assert not s.requests and s.bm.num_free_blocks == 31


def test_mixed_budget_caps_steps_that_carry_decodes():
    """max_mixed_batched_tokens: with decodes in the step, prompts get only what the
    cap leaves; a step without decodes uses the whole budget."""
    s = Scheduler(SchedulerLimits(8, 16, 64, max_mixed_batched_tokens=6), 64, BS, True)
    s.add(req("a", 12))
    p = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 12)]  # no decodes: the whole budget
    s.add(req("b", 12, first=40))
    p = run_step(s)  # a decodes (1 token), b's prompt gets 6 - 1 = 5
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 5)]
    assert p.num_batched_tokens == 6
    p = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 5)]
    with pytest.raises(ValueError, match="max_mixed_batched_tokens"):
        SchedulerLimits(8, 16, 64, max_mixed_batched_tokens=0)


def test_mixed_token_align_ends_steps_with_decodes_on_a_multiple():
    """mixed_token_align: a step that carries decodes and passes the multiple gives its
    last prompt chunk's overshoot to the next step, and a cut chunk ends the step; a chunk
    another prompt can follow is taken whole (the step fills its budget); steps without
    decodes, and steps under the multiple, are not cut."""
    s = Scheduler(SchedulerLimits(8, 32, 128, mixed_token_align=8), 64, BS, True)
    s.add(req("a", 5))
    assert [(q.request_id, q.num_tokens) for q in run_step(s).seqs] == [("a", 5)]  # no decodes
    s.add(req("b", 20, first=40))
    p = run_step(s)  # 1 decode + 20 = 21 tokens, b is the last chunk: it takes 15, the step ends at 16
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 15)]
    assert p.num_batched_tokens == 16
    p = run_step(s)  # 1 + 5 = 6 tokens: under the multiple
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 5)]
    s.add(req("c", 20, first=70))
    s.add(req("d", 7, first=100))
    p = run_step(s)  # 2 decodes; d follows c, so c is whole (22); d is last: 22 + 7 = 29, cut to 2
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 1), ("c", 20), ("d", 2)]
    assert p.num_batched_tokens == 24
    p = run_step(s)  # 3 decodes + d's 5 = 8
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]
    with pytest.raises(ValueError, match="mixed_token_align"):
        SchedulerLimits(8, 16, 64, mixed_token_align=0)


def test_mixed_token_align_cuts_a_running_prefill_no_waiting_prompt_can_follow():
    """A running prefill's chunk is the step's last when the waiting prompt cannot be admitted
    (every sequence slot taken): it is cut to end the step on the multiple."""
    s = Scheduler(SchedulerLimits(2, 32, 128, mixed_token_align=8), 64, BS, True)
    s.add(req("a", 5))
    run_step(s)
    s.add(req("b", 40, first=40))
    p = run_step(s)  # 1 + 31 = 32: on the multiple
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 31)]
    s.add(req("c", 5, first=90))  # waits: max_num_seqs = 2
    p = run_step(s)  # b's last 9 would end the step at 10: cut to 7, the step ends at 8
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [("a", 1), ("b", 7)]


def test_mixed_token_align_never_starves_a_short_prompt():
    """5 decodes already pass a multiple of 4: a 2-token prompt cannot end the step on
    one, so it is taken whole rather than left waiting behind the decodes."""
    s = Scheduler(SchedulerLimits(16, 64, 128, mixed_token_align=4), 64, BS, True)
    for i in range(5):
        s.add(req(f"d{i}", 3, first=10 + 5 * i))
    run_step(s)
    s.add(req("p", 2, first=90))
    p = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in p.seqs] == [(f"d{i}", 1) for i in range(5)] + [("p", 2)]


def test_retract_requeues_a_failed_step_and_uncaches_its_blocks():
    """A step that raised: its requests recompute from the start (in plan order, ahead of the
    queue), and blocks it was to fill are not found by a later lookup (their KV may be unwritten)."""
    s = make(budget=64)
    s.add(req("a", 9))  # two full blocks of 4, then a partial one
    run_step(s)  # a: prefilled, one token out
    s.add(req("b", 10, first=50))
    s.add(req("c", 3, first=90))
    cached_before = dict(s.bm.cached)
    plan = s.schedule()  # a decodes; b and c prefill (b's two full blocks get hashed)
    assert [q.request_id for q in plan.seqs] == ["a", "b", "c"]
    assert len(s.bm.cached) > len(cached_before)
    s.retract(plan)
    assert s.bm.cached == cached_before  # a's prompt blocks (computed before) stay findable
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"] and not s.running
    assert all(r.num_computed_tokens == 0 and r.num_pending == 0 and not r.block_ids for r in s.waiting)
    assert s.num_preemptions == 0 and s.bm.num_free_blocks == s.bm.num_usable_blocks
    again = run_step(s)  # everything is planned again, a recomputing prompt + output
    assert [(q.request_id, q.start) for q in again.seqs] == [("a", 8), ("b", 0), ("c", 0)]


def test_the_numpy_mirrors_equal_the_lists_and_a_view_keeps_its_values_as_tokens_arrive():
    """What the sampler reads (prompt_array, output_array) equals the request's lists; a view
    handed to a step keeps its values while later tokens are appended (and the buffer grows)."""
    r = req("a", 3)
    views = []
    for t in range(40):
        views.append(r.output_array)
        r.append_output_token(100 + t)
    assert r.output_array.tolist() == r.output_token_ids == list(range(100, 140))
    assert all(v.tolist() == list(range(100, 100 + i)) for i, v in enumerate(views))
    assert r.prompt_array.tolist() == r.prompt_token_ids and not r.prompt_array.flags.writeable


def test_a_grammar_request_plans_ahead_when_the_runner_samples_after_launch():
    s = Scheduler(SchedulerLimits(8, 64, 64), 32, BS, grammar_after_launch=True)
    c = waits_for_tokens("c", 4)
    s.add(c)
    p1, p2 = s.schedule(), s.schedule()
    assert [q.request_id for q in p1.seqs] == [q.request_id for q in p2.seqs] == ["c"]
    assert p2.seqs[0].sample.pending == 1 and p2.seqs[0].sample.grammar is c.grammar


def test_prompt_logprob_rows_are_planned_ahead_once_each():
    """A prompt's chunks are planned before the earlier ones' rows come back (async
    scheduling): each row is planned once, in order, also when the request is preempted
    with a chunk on the device; a retracted chunk's rows are planned again."""
    s = make(budget=8, max_len=64)
    c = req("c", 20, max_tokens=2, prompt_logprobs=1)
    s.add(c)
    p1, p2 = s.schedule(), s.schedule()  # rows 0-7 and 8-15, neither collected yet
    rows = [(q.prompt_rows_start, len(q.prompt_targets)) for p in (p1, p2) for q in p.seqs]
    assert rows == [(0, 8), (8, 8)]
    assert p2.seqs[0].prompt_targets == tuple(c.prompt_token_ids[9:17])
    s._preempt(c)  # p2's rows are still on the device: the recompute starts after them
    s.update(p1, _out(p1))
    p3, p4 = s.schedule(), s.schedule()  # recomputes tokens 0-7 and 8-15 (p2 not back yet): no rows
    s.update(p2, _out(p2))
    assert [(q.start, q.prompt_targets) for p in (p3, p4) for q in p.seqs] == [(0, ()), (8, ())]
    assert len(c.prompt_logprobs) == 16
    s.update(p3, _out(p3))
    p5 = s.schedule()  # 16-19: rows 16-18, then the first sample
    assert [len(q.prompt_targets) for q in p5.seqs] == [3]
    s.retract(p5)  # never computed: the request recomputes, and those rows are planned again
    s.update(p4, _out(p4))
    planned = []
    while not c.prompt_logprobs[16:]:
        p = s.schedule()
        planned += [(q.start, q.prompt_rows_start, len(q.prompt_targets)) for q in p.seqs]
        s.update(p, _out(p))
    assert planned == [(0, 16, 0), (8, 16, 0), (16, 16, 3)] and len(c.prompt_logprobs) == 19

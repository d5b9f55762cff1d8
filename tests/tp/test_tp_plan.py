"""What the driver sends the tensor-parallel ranks for a step (engine/tp/plan.py), without
spawning ranks: each message is pickled and unpickled, as over a rank's pipe.

A request's sampling parameters and prompt travel with the first plan that samples it, then
as a reference, and its output by the tokens the rank has not had; the rank keeps them (and the
mask tables it builds from them) until the driver drops them. Comparator: the masked logits of the rows the rank rebuilds, torch.equal to those
of the planned rows building their tables for the call."""
from __future__ import annotations

import pickle
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from detent.engine.tp.plan import KeptParams, ParamsRef, PlanSender
from detent.sampling import processors as P
from detent.sampling.params import SamplingParams
from detent.sampling.sampler import SamplingRow
from detent.scheduler.outputs import ScheduledSeq, SchedulerOutput

V = 3_000


def _plan(requests: dict, step: int, finished=()) -> SchedulerOutput:
    """One decode row per request (request id -> (params, mask ids)), its output `step` tokens long."""
    seqs = tuple(ScheduledSeq(rid, (9,), 20 + step, (1, 2), SamplingRow(
        p, 3, 21 + step, output_token_ids=[6] * step, eos_token_ids=(0,), mask_ids=masks))
        for rid, (p, masks) in requests.items())
    return SchedulerOutput(seqs, len(seqs), finished_ids=tuple(finished))


def _send(sender: PlanSender, rank: KeptParams, plan) -> tuple[SchedulerOutput, int]:
    """The plan as the rank runs it, and the size of its message."""
    data = pickle.dumps(sender.message("execute", plan), protocol=pickle.HIGHEST_PROTOCOL)
    kind, sent, params, drop = pickle.loads(data)
    return rank.plan(sent, params, drop), len(data)


def _masks(plan: SchedulerOutput, seed: int, per_call: bool = False) -> torch.Tensor:
    """The plan's rows' masked logits (`per_call`: the rows build their tables for the call)."""
    x = torch.randn(len(plan.seqs), V, generator=torch.Generator().manual_seed(seed))
    return P.apply_request_masks(x, [replace(s.sample, mask_ids=None) if per_call else s.sample for s in plan.seqs])


def _same_masks(got: SchedulerOutput, plan: SchedulerOutput, seed: int) -> bool:
    return torch.equal(_masks(got, seed), _masks(plan, seed, per_call=True))


def test_a_tensor_parallel_rank_builds_a_requests_tables_once(monkeypatch):
    """50k bad words pickled into every step's plan made each message 0.5 MB. A request's
    parameters reach a rank with its first plan; later messages carry a reference, as small as
    a plain request's, and the rank indexes its bad words and builds its ids once, from the
    parameters it keeps (the driver builds none: it does not sample)."""
    built = []
    real_words, real_ids = P.BadWords, P.build_mask_ids
    monkeypatch.setattr(P, "BadWords", lambda words, V: built.append("words") or real_words(words, V))
    monkeypatch.setattr(P, "build_mask_ids", lambda *a: built.append("ids") or real_ids(*a))
    rng = random.Random(0)
    words = [[5], [6, 7]] + [[rng.randrange(8, V), rng.randrange(V)] for _ in range(50_000)]
    hostile = SamplingParams(min_tokens=50, max_tokens=60, stop_token_ids=list(range(100, 200)),
                             bad_words_token_ids=words, logit_bias={t: 0.5 for t in range(1_000, 2_000)})
    plain = SamplingParams()
    sizes, on_rank = {}, []
    for name, requests in (("hostile", {"h": hostile, "o": plain}), ("plain", {"p": plain, "o": plain})):
        requests = {rid: (p, P.RequestMaskIds(p, (0,))) for rid, p in requests.items()}
        sender, rank = PlanSender(), KeptParams()
        sizes[name] = []
        for step in range(6):
            plan = _plan(requests, step)
            got, size = _send(sender, rank, plan)
            sizes[name].append(size)
            built.clear()
            masked = _masks(got, step)
            on_rank += built
            assert torch.equal(masked, _masks(plan, step, per_call=True))
            assert all(g.sample.params == s.sample.params for g, s in zip(got.seqs, plan.seqs))
        assert not any(m._by_vocab or m._bad_words_by_vocab for _, m in requests.values())  # the driver's
    assert sorted(on_rank) == ["ids", "words"]  # the hostile request's, once
    assert sizes["hostile"][0] > 400_000
    assert all(h <= p + 64 for h, p in zip(sizes["hostile"][1:], sizes["plain"][1:])), sizes
    # the first plan also carries a plain request's parameters, once
    assert sizes["plain"][0] > sizes["plain"][1]


def test_the_ranks_drop_a_requests_parameters_when_it_finishes_or_to_make_room():
    """The rank holds what the driver's record says it holds: a finished request's parameters
    go with the next plan's finished_ids, the least recently planned ones when more than the
    capacity are kept (sent again when planned again), and a reused request id gets its new
    request's parameters."""
    params = {rid: SamplingParams(bad_words_token_ids=[[i + 10]], logit_bias={i: 1.0})
              for i, rid in enumerate("abcd")}
    masks = {rid: P.RequestMaskIds(p) for rid, p in params.items()}
    sender, rank = PlanSender(capacity=2), KeptParams()

    def step(rids, finished=(), seed=0):
        plan = _plan({r: (params[r], masks[r]) for r in rids}, 1, finished)
        got, _ = _send(sender, rank, plan)
        assert _same_masks(got, plan, seed)
        assert sorted(rank.kept) == sorted(sender.kept)
        return sorted(rank.kept)

    assert step("ab") == ["a", "b"]
    assert step("b", finished="a") == ["b"]
    assert step("bcd") == ["b", "c", "d"]  # all three planned: none dropped for room
    assert step("c") == ["c", "d"]  # b, the least recently planned, made room
    assert step("bc", seed=1) == ["b", "c"]  # b again, sent again
    params["b"] = SamplingParams(bad_words_token_ids=[[99]])
    masks["b"] = P.RequestMaskIds(params["b"])
    assert step("b", finished="b", seed=2) == ["b", "c"]  # "b" reused: the new request's
    assert rank.kept["b"].masks.key == masks["b"].key


def test_a_rank_that_lacks_a_requests_parameters_fails_the_step():
    """A rank asked for parameters it does not hold (one that missed the message that sent
    them) raises, naming the request, rather than sample under others."""
    p = SamplingParams(bad_words_token_ids=[[5]])
    requests = {"a": (p, P.RequestMaskIds(p))}
    sender = PlanSender()
    _send(sender, KeptParams(), _plan(requests, 0))
    kind, sent, params, drop = pickle.loads(pickle.dumps(sender.message("execute", _plan(requests, 1))))
    assert params == {} and isinstance(sent.seqs[0].sample.mask_ids, ParamsRef)
    with pytest.raises(LookupError, match="no sampling parameters for request 'a'"):
        KeptParams().plan(sent, params, drop)


def test_a_requests_prompt_travels_once_and_its_output_by_its_new_tokens():
    """Every row's prompt (for the penalties) and output were pickled at every step: 8 bytes a
    token, 4 MB a step for 64 rows of 8k-token prompts. The rank gets the prompt once and the
    output's new tokens, and rebuilds both equal (==, int64) to the driver's."""
    rng = random.Random(1)
    prompt = np.asarray([rng.randrange(V) for _ in range(8_000)], dtype=np.int64)
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)
    masks = P.RequestMaskIds(p)
    sender, rank, outs, sizes = PlanSender(), KeptParams(), [], []
    for step in range(6):
        outs += [rng.randrange(V) for _ in range(3)]  # more than one new token a plan: async steps
        plan = SchedulerOutput((ScheduledSeq("a", (9,), 20 + step, (1, 2), SamplingRow(
            p, 3, 21 + step, prompt_token_ids=prompt, output_token_ids=np.asarray(outs), mask_ids=masks)),), 1)
        got, size = _send(sender, rank, plan)
        sizes.append(size)
        row = got.seqs[0].sample
        assert row.prompt_token_ids.dtype == row.output_token_ids.dtype == np.int64
        assert row.prompt_token_ids.tolist() == prompt.tolist() and row.output_token_ids.tolist() == outs
        assert _same_masks(got, plan, step) and row.params == p
    assert sizes[0] > 64_000 and max(sizes[1:]) < 2_000, sizes
    # a rank that missed tokens fails the step rather than penalise other ones
    kind, sent, params, drop = pickle.loads(pickle.dumps(sender.message("execute", plan)))
    with pytest.raises(LookupError, match="holds 0 output tokens"):
        KeptParams().plan(sent, {"a": (masks, prompt.copy())}, drop)


def test_a_rank_takes_the_bad_words_index_a_server_built(monkeypatch):
    """detent-serve indexes a request's bad words on its worker pool (`checked_params`), not on the
    engine's step thread (33 ms for 100k words); the index travels with the params to the engine
    core and, with the request's first plan, to each rank, which builds none either. The rank's
    masks are those of the same words indexed for the call."""
    from detent.engine import checked_params
    built, real = [], P.BadWords.__init__  # the class itself stays: the index is pickled
    monkeypatch.setattr(P.BadWords, "__init__", lambda self, words, V: built.append(V) or real(self, words, V))
    words = [[5], [6, 7]] + [[t, t + 1] for t in range(8, 2_000)]
    served = pickle.loads(pickle.dumps(checked_params(SamplingParams(max_tokens=60, bad_words_token_ids=words), V)))
    requests = {"s": (served, P.RequestMaskIds(served, (0,)))}
    sender, rank = PlanSender(), KeptParams()
    for step in range(3):
        built.clear()
        got, _ = _send(sender, rank, _plan(requests, step))
        masked = _masks(got, step)
        assert built == []
        unchecked = _plan({"s": (replace(served), None)}, step)  # a replace()d copy is unchecked
        assert torch.equal(masked, _masks(unchecked, step, per_call=True)) and built == [V]

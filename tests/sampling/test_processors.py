"""Sampler details: request masks, logprob modes vs float64, ranks, top-k ties, fallbacks, golden rows."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from detent.sampling import processors as P
from detent.sampling.params import SamplingParams, StructuredOutputs, TokenWords
from detent.sampling.sampler import SamplingRow, sample, sample_async

from .reference import reference_probs
from .test_distribution import fixed_logits
from .tiny_vocab import EOS, VOCAB, V, tiny_cache
from .test_grammar import wait


def rows(params, n=1, **kw):
    return [SamplingRow(params, seed=s, position=3, **kw) for s in range(n)]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(300, 8)
    logits[:, 1] = 30.0  # EOS dominates
    logits[:, 5] = 29.0  # a stop token id next
    p = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[5])
    early = sample(logits, rows(p, 300, eos_token_ids=(1,), output_token_ids=[3])).token_ids
    assert 1 not in early and 5 not in early
    late = sample(logits, rows(p, 300, eos_token_ids=(1,), output_token_ids=[3, 3])).token_ids
    assert 1 in late


def test_allowed_token_ids_and_logit_bias():
    logits = fixed_logits()
    out = sample(logits[None].expand(500, -1).contiguous(),
                 rows(SamplingParams(allowed_token_ids=[3, 4, 40]), 500)).token_ids
    assert set(out) <= {3, 4, 40} and len(set(out)) >= 2
    worst = int(torch.argmin(logits))
    greedy = sample(logits[None], rows(SamplingParams(temperature=0, logit_bias={worst: 100}))).token_ids
    assert greedy == [worst]


def test_bad_words_ban_a_word_only_where_it_would_complete():
    logits = fixed_logits()
    top = [int(t) for t in torch.argsort(logits, descending=True)[:3]]
    a, b, c = top
    greedy = lambda p, out=(): sample(logits[None], rows(p, output_token_ids=list(out))).token_ids[0]  # noqa: E731
    base = dict(temperature=0)
    assert greedy(SamplingParams(**base)) == a
    assert greedy(SamplingParams(bad_words_token_ids=[[a]], **base)) == b  # one token: never sampled
    two = SamplingParams(bad_words_token_ids=[[7, a], [b]], **base)
    assert greedy(two, out=[5, 7]) == c  # the output ends with 7: a would complete [7, a]
    assert greedy(two, out=[7, 5]) == a  # it does not: a is free
    assert greedy(two) == a
    for bad in ([[]], [["x"]], [[-1]]):
        with pytest.raises(ValueError, match="bad_words_token_ids"):
            SamplingParams(bad_words_token_ids=bad)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[V]]).verify_vocab(V)


def test_processed_logprobs_equal_the_float64_reference():
    logits = fixed_logits()
    kw = dict(temperature=0.7, top_k=6, top_p=0.8, repetition_penalty=1.2)
    out = sample(logits[None], rows(SamplingParams(logprobs=V, logprobs_mode="processed", seed=1, **kw),
                                    prompt_token_ids=[1, 2, 3]))
    got = np.full(V, -np.inf)
    got[out.topk_ids[0]] = out.topk_logprobs[0]
    ref = reference_probs(logits.numpy(), prompt_ids=[1, 2, 3], **kw)
    assert np.array_equal(np.isfinite(got), ref > 0)  # the same kept set
    assert np.allclose(np.exp(got[ref > 0]), ref[ref > 0], rtol=1e-5, atol=1e-6)
    assert out.topk_ids[0][0] == int(np.argmax(ref))


def test_raw_logprobs_ranks_and_topk_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -2.0]])
    out = sample(logits, rows(SamplingParams(temperature=0, logprobs=4)))
    assert out.token_ids == [1]
    assert torch.equal(torch.tensor(out.topk_logprobs[0]), torch.log_softmax(logits, -1)[0, [1, 2, 4, 0]])
    assert out.topk_ids[0] == [1, 2, 4, 0] and out.ranks == [1]  # ties to the lower id
    g = sample(logits, rows(SamplingParams(temperature=0, logprobs=1), golden_token=3))
    assert g.token_ids == [3] and g.ranks == [5]  # 4 tokens have a strictly larger logprob
    raw = sample(logits, rows(SamplingParams(temperature=0, logprobs=2, logprobs_mode="raw_logits")))
    assert raw.logprobs == [3.0] and raw.topk_logprobs[0] == [3.0, 3.0]


def test_golden_row_reports_the_same_as_a_greedy_row_emitting_that_token():
    logits = fixed_logits()[None]
    greedy = sample(logits, rows(SamplingParams(temperature=0, logprobs=5)))
    golden = sample(logits, rows(SamplingParams(temperature=1.3, top_k=3, seed=4, logprobs=5),
                                 golden_token=greedy.token_ids[0]))
    assert (golden.token_ids, golden.logprobs, golden.ranks, golden.topk_ids, golden.topk_logprobs) == \
           (greedy.token_ids, greedy.logprobs, greedy.ranks, greedy.topk_ids, greedy.topk_logprobs)


def test_grammar_mask_wins_when_truncation_keeps_no_allowed_token():
    """top_k=1 keeps only the argmax; the grammar allows other tokens: the allowed set is sampled."""
    st = wait(tiny_cache().new_state(StructuredOutputs(regex="[a-f][0-9]+")))
    logits = torch.zeros(400, V)
    logits[:, EOS] = 20.0
    out = sample(logits, rows(SamplingParams(temperature=1.0, top_k=1), 400, grammar=st)).token_ids
    allowed = {VOCAB.index(c) for c in "abcdef"} | {VOCAB.index("a1"), VOCAB.index("b2")}
    assert set(out) <= allowed and len(set(out)) > 3


def test_seed_position_and_sample_index_key_the_draw():
    logits = torch.zeros(1, 1000)  # uniform: the token is the noise's argmax
    base = SamplingParams(temperature=1.0)

    def tok(seed=0, position=0, sample_index=0):
        return sample(logits, [SamplingRow(base, seed=seed, position=position, sample_index=sample_index)]).token_ids[0]

    t = tok()
    assert t == tok()
    assert len({t, tok(seed=1), tok(position=1), tok(sample_index=1)}) == 4


def test_candidate_noise_path_equals_full_vocabulary_path():
    """top_k=5 alone draws noise at 5 ids; beside an untruncated row the whole vocabulary is drawn."""
    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0)) * 2
    for s in range(100):
        row = SamplingRow(SamplingParams(temperature=1.0, top_k=5), seed=s, position=s)
        wide = SamplingRow(SamplingParams(temperature=1.0), seed=s, position=s)
        alone = sample(logits[:1], [row]).token_ids[0]
        assert sample(logits, [row, wide]).token_ids[0] == alone


def test_a_huge_top_k_keeps_every_token_instead_of_overflowing():
    """top_k = 2**70 overflowed the sampler's long tensor and failed the whole step."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g)
    huge = SamplingParams(temperature=1.0, top_k=-1, top_p=0.9, seed=1, logprobs=3)
    object.__setattr__(huge, "top_k", 2 ** 70)  # past SamplingParams' own bound: the sampler must still cope
    rows = [SamplingRow(p, seed=1, position=4)
            for p in (huge, SamplingParams(temperature=1.0, top_k=-1, top_p=0.9, seed=1, logprobs=3))]
    a = sample(logits, rows[:1])
    b = sample(logits, rows[1:])
    assert (a.token_ids, a.logprobs, a.topk_ids) == (b.token_ids, b.logprobs, b.topk_ids)


def test_a_step_without_logprobs_skips_the_distribution_and_samples_the_same_tokens(monkeypatch):
    # no row asks for logprobs: no [B, V] log-softmax (NaN logprobs, rank 0, never reported);
    # one row asks: the whole step computes them as before. The tokens are the same either way
    from detent.selection import ops
    calls = []
    real = ops.log_softmax
    monkeypatch.setattr(ops, "log_softmax", lambda x: calls.append(x.shape) or real(x))
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    plain = [SamplingRow(SamplingParams(temperature=0.8, seed=i, top_k=20), seed=i, position=5) for i in range(4)]
    out = sample(x, plain)
    assert calls == [] and out.ranks == [0] * 4 and all(v != v for v in out.logprobs)  # NaN
    asked = plain[:3] + [SamplingRow(SamplingParams(temperature=0.8, seed=3, top_k=20, logprobs=0), seed=3,
                                     position=5)]
    out2 = sample(x, asked)
    assert calls == [(4, V)] and out2.token_ids == out.token_ids
    assert out2.ranks[3] >= 1
    assert abs(out2.logprobs[3] - torch.log_softmax(x[3].double(), -1)[out2.token_ids[3]].item()) < 1e-5


@pytest.mark.parametrize("pending_token", [7, 8], ids=["completes a bad word's prefix", "does not"])
def test_a_pending_last_token_counts_as_the_same_token_on_the_host(pending_token):
    """A row whose last output token is still on the device (`pending`, read from `last_tokens`)
    samples and reports exactly what the same row with that token on the host does:
    penalties count it, min_tokens counts it, and a bad word whose prefix it ends is banned."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=g)
    p = SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3,
                       min_tokens=4, bad_words_token_ids=[[6, 7, 9], [8, 11], [12]], logprobs=5,
                       logprobs_mode="processed")
    before = [5, 6]
    host = [SamplingRow(p, seed=s, position=9, prompt_token_ids=[1, 2], output_token_ids=before + [pending_token],
                        eos_token_ids=[3]) for s in range(3)]
    device = [SamplingRow(p, seed=s, position=9, prompt_token_ids=[1, 2], output_token_ids=before,
                          eos_token_ids=[3], pending=1) for s in range(3)]
    a = sample(logits, host)
    b = sample_async(logits, device, torch.full((3,), pending_token)).resolve()
    assert (a.token_ids, a.logprobs, a.ranks, a.topk_ids, a.topk_logprobs) == \
        (b.token_ids, b.logprobs, b.ranks, b.topk_ids, b.topk_logprobs)
    masked = P.apply_request_masks(logits, device, torch.full((3,), pending_token))
    # EOS (3 outputs < min_tokens 4), the one-token word, and the word the pending token's prefix completes
    assert set(torch.nonzero(masked[0] == float("-inf")).flatten().tolist()) == {3, 12, 9 if pending_token == 7 else 11}
    with pytest.raises(ValueError, match="no last_tokens"):
        sample_async(logits, device)


def _masks_reference(x, rows, last):
    """apply_request_masks one row at a time, from the parameters' lists as written."""
    out = x.clone()
    V = x.shape[1]
    for i, r in enumerate(rows):
        p, row = r.params, out[i]
        if p.allowed_token_ids:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[[t for t in p.allowed_token_ids if t < V]] = True
            row[~keep] = P.NEG_INF
        for t, v in (p.logit_bias or {}).items():
            if t < V:
                row[t] = row[t] + torch.tensor(v, dtype=torch.float32)
        outs = list(r.output_token_ids) + ([int(last[i])] if r.pending else [])
        if len(outs) < p.min_tokens:
            for t in (*r.eos_token_ids, *p.stop_token_ids):
                if t < V:
                    row[t] = P.NEG_INF
        for w in p.bad_words_token_ids or ():
            n = len(w) - 1
            if w[-1] < V and (n == 0 or outs[len(outs) - n:] == w[:-1] and len(outs) >= n):
                row[w[-1]] = P.NEG_INF
    return out


def _masked_rows(rng, V, B, cache: bool):
    rows = []
    for _ in range(B):
        kw = {}
        if rng.random() < 0.4:  # ids up to V + 2: the ones outside the vocabulary are skipped
            kw["allowed_token_ids"] = [int(t) for t in rng.integers(0, V + 3, size=rng.integers(1, 7))]
        if rng.random() < 0.5:
            kw["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V + 3, size=4)}
        if rng.random() < 0.6:
            kw.update(min_tokens=int(rng.integers(0, 5)), max_tokens=10,
                      stop_token_ids=[int(t) for t in rng.integers(0, V + 3, size=rng.integers(0, 7))])
        if rng.random() < 0.4:
            kw["bad_words_token_ids"] = [[int(t) for t in rng.integers(0, V + 2, size=rng.integers(1, 4))]
                                         for _ in range(2)]
        p = SamplingParams(**kw)
        eos = tuple(int(t) for t in rng.choice(V + 2, size=rng.integers(0, 3), replace=False))
        rows.append(dict(params=p, eos_token_ids=eos, **({"mask_ids": P.RequestMaskIds(p, eos)} if cache else {})))
    return rows


@pytest.mark.parametrize("cache", [True, False], ids=["ids built once per request", "ids built per call"])
def test_request_masks_equal_a_row_by_row_reference(cache):
    """allowed_token_ids, logit_bias, min_tokens' bans and bad words, on random small rows whose
    outputs grow over five steps (some with a pending last token): the masked logits are
    torch.equal to the reference's, whether a row's ids are built once and kept or per call."""
    rng = np.random.default_rng(0)
    for _ in range(150):
        V, B = int(rng.choice([5, 8, 40])), int(rng.integers(1, 5))
        reqs = _masked_rows(rng, V, B, cache)
        outs = [[] for _ in reqs]
        for _step in range(5):
            pending = [int(rng.integers(0, 2)) for _ in reqs]
            rows = [SamplingRow(seed=0, position=3, output_token_ids=list(o), pending=k, **q)
                    for q, o, k in zip(reqs, outs, pending)]
            x = torch.randn(B, V) * 3
            last = torch.from_numpy(rng.integers(0, V, size=B))
            assert torch.equal(P.apply_request_masks(x, rows, last), _masks_reference(x, rows, last))
            for o, t in zip(outs, last.tolist()):
                o.append(t)


def test_a_requests_mask_ids_are_built_once_not_every_step(monkeypatch):
    """49k stop ids under min_tokens and a large logit_bias: a request's rows share its
    RequestMaskIds, so its ids are built at its first step only (rebuilding them every step
    doubled a neighbour's time), and each step samples what rows built per call sample."""
    built = []
    build = P.build_mask_ids
    monkeypatch.setattr(P, "build_mask_ids", lambda *a: built.append(a[2]) or build(*a))
    V = 49_152
    p = SamplingParams(min_tokens=30, max_tokens=40, stop_token_ids=list(range(2, 49_000)),
                       logit_bias={t: 0.5 for t in range(40_000, 49_000)})
    ids = P.RequestMaskIds(p, (0,))
    plain = SamplingParams(seed=5)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        x = torch.randn(2, V, generator=g) * 4
        out = list(range(1000, 1000 + step))
        kept = sample(x, [SamplingRow(p, 7, 3 + step, output_token_ids=out, eos_token_ids=(0,), mask_ids=ids),
                          SamplingRow(plain, 5, 3 + step)])
        fresh = sample(x, [SamplingRow(p, 7, 3 + step, output_token_ids=out, eos_token_ids=(0,)),
                           SamplingRow(plain, 5, 3 + step)])
        assert kept.token_ids == fresh.token_ids and not 2 <= kept.token_ids[0] < 49_000
    assert built.count(V) == 12 + 1  # the rows without ids built theirs at each call; the request once
    import pickle
    assert pickle.loads(pickle.dumps(ids))._by_vocab == {}  # a plan sent to TP ranks carries no arrays


def test_a_requests_bad_words_are_indexed_once_and_each_step_looks_up_its_tail(monkeypatch):
    """100k bad words, scanned word by word at every step, took 33 ms a step for the whole batch.
    A request's words are indexed once (RequestMaskIds.bad_words, P.BadWords), and a step looks
    the output's tail up once per word length; its bans equal the reference's scan, with the last
    token known and pending, as the output grows through words' prefixes."""
    built = []
    real = P.BadWords
    monkeypatch.setattr(P, "BadWords", lambda words, V: built.append(V) or real(words, V))
    V = 6_000
    words = ([[t] for t in range(5_000, 5_900)] + [[t, t + 1] for t in range(10, 2_000)]
             + [[t, t + 1, t + 2] for t in range(2_000, 3_000)] + [[7, 6_500]])  # the last: outside V
    p = SamplingParams(bad_words_token_ids=words)
    ids = P.RequestMaskIds(p)
    g = torch.Generator().manual_seed(0)
    out = []
    for step, token in enumerate([2_000, 2_001, 10, 11, 2_500, 7]):
        for pending in (0, 1):
            rows = [SamplingRow(p, 3, 4 + step, output_token_ids=list(out), pending=pending, mask_ids=ids),
                    SamplingRow(SamplingParams(), 5, 4 + step)]
            x = torch.randn(2, V, generator=g) * 3
            last = torch.tensor([out[-1] if out else 0, 0])
            if pending:  # the host has not seen the last token yet
                rows[0] = SamplingRow(p, 3, 4 + step, output_token_ids=list(out[:-1]), pending=1, mask_ids=ids)
            assert torch.equal(P.apply_request_masks(x, rows, last), _masks_reference(x, rows, last))
        out.append(token)
    assert built == [V]  # once for the request, not at each of its 12 calls


@pytest.mark.parametrize("pickled", [False, True])
def test_a_requests_bad_words_index_built_by_word_length_bans_what_the_reference_scan_bans(pickled):
    """detent-serve's engine core admits a request between two steps (engine/core_process.py), so
    its bad words are indexed there: word by word, 100k words took 350 ms, a stall of every running
    request; built with numpy (a sort per word length) about 40 ms (measured, not asserted here:
    speed lives in benchmarks/). Its bans stay those of the reference scan, with the last token known
    or pending and words of every length up to 4 (duplicates and a word whose last token is outside
    V too); also from the words as the core receives them (`pickled`: a `TokenWords`)."""
    rng = np.random.default_rng(5)
    V = 30
    small = [rng.integers(0, V, size=int(rng.integers(1, 5))).tolist() for _ in range(40)] + [[3, 4], [3, 4], [2, V]]
    p = SamplingParams(bad_words_token_ids=small)
    if pickled:
        p = pickle.loads(pickle.dumps(p))
        assert isinstance(p.bad_words_token_ids, TokenWords)
    ids = P.RequestMaskIds(p)
    for step in range(60):
        out = rng.integers(0, 6, size=step % 7).tolist()
        pending = int(bool(out) and step % 2)
        row = SamplingRow(p, 3, 4, output_token_ids=out[:len(out) - pending], pending=pending, mask_ids=ids)
        x = torch.randn(1, V, generator=torch.Generator().manual_seed(step))
        last = torch.tensor([out[-1] if out else 0])
        assert torch.equal(P.apply_request_masks(x, [row], last), _masks_reference(x, [row], last))


def test_the_ids_min_tokens_bans_have_one_definition_for_the_mask_and_the_engines_check(monkeypatch):
    """The ids banned while min_tokens holds were listed twice: in the sampler's mask ids and in the
    engine's check that allowed_token_ids leave a token to sample, free to drift apart. Both read
    `processors.min_tokens_bans`: a change to it (here, banning id 9 as well) reaches the two."""
    from .engine_util import tiny_llm
    llm = tiny_llm(V)
    p = SamplingParams(temperature=0, max_tokens=2, min_tokens=2, allowed_token_ids=[9], stop_token_ids=[5])
    x = torch.zeros(1, V)
    row = SamplingRow(p, 0, 3, eos_token_ids=(1,))
    assert not torch.isinf(P.apply_request_masks(x, [row])[0, 9])
    assert llm.generate([{"prompt_token_ids": [3, 4]}], p, use_tqdm=False)[0].outputs[0].token_ids == [9, 9]
    real = P.min_tokens_bans
    monkeypatch.setattr(P, "min_tokens_bans", lambda params, eos: np.append(real(params, eos), 9))
    assert torch.isinf(P.apply_request_masks(x, [SamplingRow(p, 0, 3, eos_token_ids=(1,))])[0, 9])
    with pytest.raises(ValueError, match="min_tokens=2 bans EOS and stop_token_ids"):
        llm.generate([{"prompt_token_ids": [3, 4]}], p, use_tqdm=False)


def test_bad_words_cross_a_process_boundary_as_two_arrays_equal_to_the_lists():
    """100k bad words unpickled as 100k lists held the engine core 43-190 ms between two steps (the
    collector walked them as they came); `SamplingParams` pickles them as a `TokenWords` (two
    arrays), which reads as the same lists: equality, items, iteration, the request log's lists,
    and the vocabulary check's message. The params a caller holds keep their lists."""
    from detent.engine.log_record import params_json
    words = [[5, 6, 7], [9], [2, 2], [11, 3, 0, 4]]
    p = SamplingParams(bad_words_token_ids=words, stop_token_ids=[3])
    q = pickle.loads(pickle.dumps(p))
    w = q.bad_words_token_ids
    assert isinstance(w, TokenWords) and isinstance(p.bad_words_token_ids, list)
    assert w == words and list(w) == words and len(w) == 4 and w[1] == [9] and w[-1] == [11, 3, 0, 4]
    assert w[1:3] == [[9], [2, 2]] and w != words[:3] and pickle.loads(pickle.dumps(q)).bad_words_token_ids == words
    assert params_json(q, 1)["bad_words_token_ids"] == params_json(p, 1)["bad_words_token_ids"] == words
    for params in (p, q):
        with pytest.raises(ValueError, match=r"^bad_words contains token id 11, outside the vocabulary \[0, 10\)$"):
            params.verify_vocab(10)
        params.verify_vocab(12)
    assert pickle.loads(pickle.dumps(SamplingParams(bad_words_token_ids=[]))).bad_words_token_ids == []

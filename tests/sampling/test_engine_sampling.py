"""Sampling through the engine on a tiny dummy-weight Llama (CPU): distribution,
batch invariance of seeded requests, golden tokens, n > 1, unseeded replay.

Comparator: token lists with ==, logprob tensors with torch.equal."""
from __future__ import annotations

import numpy as np
import pytest

from detent.engine import SamplingParams
from detent.sampling.params import StructuredOutputs

from .engine_util import result_of, same, tiny_llm
from .reference import reference_probs
from .test_distribution import ALPHA, chi2_pvalue

VOCAB = 160
TARGET_PROMPT = [(7 * i + 3) % (VOCAB - 2) + 2 for i in range(40)]  # 2.5 blocks of 16


def target_params(**kw):
    base = dict(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, logprobs=5, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def neighbours(n: int, seed: int = 1):
    """Greedy, top-k, grammar-constrained and differently-seeded requests (same prompt for one)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = TARGET_PROMPT if i == 0 else rng.integers(2, VOCAB, size=int(rng.integers(3, 70))).tolist()
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=1.0, top_p=0.95, seed=99 + i, max_tokens=12, logprobs=5, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(temperature=0.8, top_k=5, seed=i, max_tokens=14, logprobs=2, ignore_eos=True)
        else:
            p = SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                               structured_outputs=StructuredOutputs(regex="[a-f]{2,6}-[0-9]{1,4}"))
        out.append(({"prompt_token_ids": prompt}, p))
    return out


def run_target(llm, others=(), row=None):
    others = list(others)
    row = len(others) if row is None else row
    reqs = others[:row] + [({"prompt_token_ids": TARGET_PROMPT}, target_params())] + others[row:]
    outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
    return result_of(outs[row])


_REF = {}


def reference(sel="pinned"):
    if sel not in _REF:
        _REF[sel] = run_target(tiny_llm(VOCAB, sel))
    return _REF[sel]


def cell_neighbours_row0(sel):
    return run_target(tiny_llm(VOCAB, sel), neighbours(7), row=0)


def cell_neighbours_middle(sel):
    return run_target(tiny_llm(VOCAB, sel), neighbours(12, seed=2), row=6)


def cell_neighbours_last(sel):
    return run_target(tiny_llm(VOCAB, sel), neighbours(20, seed=3))


def cell_chunked_prefill(sel):
    return run_target(tiny_llm(VOCAB, sel, max_num_batched_tokens=13), neighbours(3, seed=4), row=1)


def cell_prefix_hit(sel):
    llm = tiny_llm(VOCAB, sel)
    llm.generate([{"prompt_token_ids": TARGET_PROMPT[:32] + [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    r = run_target(llm, neighbours(3, seed=5))
    assert r.num_cached_tokens == 32, "the cell did not exercise the prefix cache"
    return r


def cell_preempt(sel):
    llm = tiny_llm(VOCAB, sel, max_model_len=64, num_gpu_blocks=9)
    others = [({"prompt_token_ids": [3 + i] * 8}, SamplingParams(temperature=0.7, seed=i, max_tokens=40, ignore_eos=True))
              for i in range(3)]
    r = run_target(llm, others)
    assert r.num_preemptions >= 1, "the target was not preempted"
    return r


CELLS = {f.__name__[5:]: f for f in (cell_neighbours_row0, cell_neighbours_middle, cell_neighbours_last,
                                      cell_chunked_prefill, cell_prefix_hit, cell_preempt)}


@pytest.mark.parametrize("cell", list(CELLS))
def test_seeded_request_is_invariant(cell):
    ref = reference()
    assert len(ref.token_ids) == 16 and len(set(ref.token_ids)) > 3  # really sampled, not degenerate
    got = CELLS[cell]("pinned")
    assert same(got, ref), f"{cell}: seeded request differs from the request alone"


def test_stock_selection_breaks_some_cell():
    ref = reference("stock")
    differing = [c for c in ("neighbours_middle", "chunked_prefill", "prefix_hit")
                 if not same(CELLS[c]("stock"), ref)]
    assert differing, "stock selection passed every cell, so the cells cannot detect a break"


def test_engine_distribution_matches_float64_reference():
    """4000 one-token samples, seeds 0..3999, T=0.8 + top_p=0.9 + repetition_penalty=1.3, vocab 64."""
    n = 4000
    prompt = [5, 9, 9, 17, 33, 40, 41]
    kw = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3)
    llm = tiny_llm(64, max_num_seqs=512, max_num_batched_tokens=4096, num_gpu_blocks=600)
    raw = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=64,
                                                                      logprobs_mode="raw_logits"),
                       use_tqdm=False)[0].outputs[0].logprobs[0]
    logits = np.array([raw[t].logprob for t in range(64)], dtype=np.float64)  # the model's logits
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(seed=s, max_tokens=1, **kw) for s in range(n)], use_tqdm=False)
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=64)
    probs = reference_probs(logits, prompt_ids=prompt, **kw)
    assert (probs > 0).sum() >= 5
    p = chi2_pvalue(counts, probs)
    assert p > ALPHA, f"engine samples vs float64 reference: chi-square p = {p:.3g}"


def test_golden_tokens_report_the_free_greedy_runs_logprobs():
    llm = tiny_llm(VOCAB)
    prompt = {"prompt_token_ids": TARGET_PROMPT}
    free = result_of(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, logprobs=5,
                                                           ignore_eos=True), use_tqdm=False)[0])
    # golden run: sampled settings and another batch, but the continuation is forced
    gp = target_params(golden_token_ids=free.token_ids)
    outs = llm.generate([prompt] + [r[0] for r in neighbours(5)], [gp] + [r[1] for r in neighbours(5)],
                        use_tqdm=False)
    assert same(result_of(outs[0]), free)


def test_golden_continuation_logprobs_equal_prompt_logprobs():
    """Teacher forcing an arbitrary continuation reports what a prefill of prompt + continuation scores."""
    llm = tiny_llm(VOCAB)
    cont = [11, 12, 13, 50, 51, 99, 3, 3]
    g = llm.generate([{"prompt_token_ids": TARGET_PROMPT}],
                     SamplingParams(temperature=0.9, seed=1, max_tokens=len(cont), logprobs=0,
                                    golden_token_ids=cont, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert g.token_ids == cont
    full = llm.generate([{"prompt_token_ids": TARGET_PROMPT + cont}],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    pl = full.prompt_logprobs[len(TARGET_PROMPT):]
    assert [d[t].logprob for d, t in zip(g.logprobs, cont)] == [d[t].logprob for d, t in zip(pl, cont)]
    assert [d[t].rank for d, t in zip(g.logprobs, cont)] == [d[t].rank for d, t in zip(pl, cont)]


def test_n_samples_keyed_by_sample_index():
    llm = tiny_llm(VOCAB)
    p = target_params(n=3, max_tokens=8)
    alone = llm.generate([{"prompt_token_ids": TARGET_PROMPT}], p, use_tqdm=False)[0]
    samples = [result_of(alone, i) for i in range(3)]
    assert len({tuple(s.token_ids) for s in samples}) == 3, "samples of one request must differ"
    # samples 2 and 3 reuse the prompt's two full blocks computed for sample 1
    assert llm.llm_engine.stats()["prefix_cache_hits"] == 2 * 32
    llm2 = tiny_llm(VOCAB)
    outs = llm2.generate([r[0] for r in neighbours(4)] + [{"prompt_token_ids": TARGET_PROMPT}],
                         [r[1] for r in neighbours(4)] + [p], use_tqdm=False)
    assert all(same(result_of(outs[-1], i), samples[i]) for i in range(3))


def test_unseeded_request_returns_its_seed_for_replay():
    llm = tiny_llm(VOCAB)
    prompt = {"prompt_token_ids": TARGET_PROMPT}
    first = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert first.seed is not None
    replay = llm.generate([prompt] + [r[0] for r in neighbours(3)],
                          [SamplingParams(temperature=1.0, seed=first.seed, max_tokens=10, ignore_eos=True)]
                          + [r[1] for r in neighbours(3)], use_tqdm=False)[0].outputs[0]
    assert replay.token_ids == first.token_ids


class _CountedIds(list):
    """stop_token_ids that count the ids read from them (a list subclass that numpy, tuple
    unpacking and set() all read through __iter__ or __getitem__)."""
    reads = 0

    def __iter__(self):
        for t in super().__iter__():
            _CountedIds.reads += 1
            yield t

    def __getitem__(self, i):
        _CountedIds.reads += 1
        return super().__getitem__(i)

    def __array__(self, dtype=None, copy=None):  # numpy would copy a list's items without __iter__
        return np.fromiter(iter(self), dtype=dtype or np.int64)


class _CountedBias(dict):
    """A logit_bias that counts the entries read from it."""
    reads = 0

    def _count(self, it):
        for v in it:
            _CountedBias.reads += 1
            yield v

    def __iter__(self):
        return self._count(super().__iter__())

    def keys(self):
        return self._count(super().keys())

    def values(self):
        return self._count(super().values())

    def items(self):
        return self._count(super().items())


def test_a_requests_long_id_lists_are_read_once_not_at_every_step(monkeypatch):
    """A request with 148 stop ids under min_tokens and a 148-id logit_bias beside a plain one:
    over its 12 steps the engine reads those lists a few times (validation, building its masks
    once), not once per step (49k stop ids per step doubled a neighbour's time). Its tokens and
    its neighbour's are those of rows whose ids are built at every step."""
    from detent.scheduler.request import Request
    ids = list(range(2, 150))
    hostile = SamplingParams(seed=3, min_tokens=12, max_tokens=14, logprobs=2)
    hostile.stop_token_ids = _CountedIds(ids)
    hostile.logit_bias = _CountedBias({t: 0.25 * (t % 5) for t in ids})
    plain = target_params()
    prompts = [{"prompt_token_ids": TARGET_PROMPT[:9]}, {"prompt_token_ids": TARGET_PROMPT}]
    llm = tiny_llm(VOCAB)
    _CountedIds.reads = _CountedBias.reads = 0
    kept = [result_of(o) for o in llm.generate(prompts, [hostile, plain], use_tqdm=False)]
    assert len(kept[0].token_ids) >= 12 and not any(t in ids for t in kept[0].token_ids[:12])
    # three passes each (validation, its stop-id set or a second field, its masks' build), not 12+
    assert _CountedIds.reads <= 4 * len(ids) and _CountedBias.reads <= 4 * len(ids), \
        (_CountedIds.reads, _CountedBias.reads)
    # rows build theirs per call: a request keeps none of the masks it is given
    monkeypatch.setattr(Request, "mask_ids", property(lambda self: None, lambda self, masks: None), raising=False)
    fresh = [result_of(o) for o in llm.generate(prompts, [hostile, plain], use_tqdm=False)]
    assert all(same(a, b) for a, b in zip(kept, fresh))


def test_a_requests_mask_tables_are_built_when_it_is_added_not_on_the_step_loop(monkeypatch):
    """100k bad words took 180 ms to index at the request's first masked step, a stall for
    every request of that step: add_request builds its tables (bad words' index, allowed ids,
    logit_bias, min_tokens' bans), and no step builds any, for either sample of n = 2 (they share
    them). Its tokens are those of rows that build their tables at every step."""
    from detent.sampling import processors as P
    built = []
    real_words, real_ids = P.BadWords, P.build_mask_ids
    monkeypatch.setattr(P, "BadWords", lambda words, V: built.append("words") or real_words(words, V))
    monkeypatch.setattr(P, "build_mask_ids", lambda *a: built.append("ids") or real_ids(*a))
    words = [[t] for t in range(100, 140)] + [[t, t + 1] for t in range(2, 100)]
    masked = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, min_tokens=3, logprobs=2,
                            bad_words_token_ids=words, logit_bias={t: 2.0 for t in range(2, 60)},
                            ignore_eos=True)
    llm = tiny_llm(VOCAB)
    eng = llm.llm_engine
    eng.add_request("masked", TARGET_PROMPT[:9], masked)
    eng.add_request("plain", TARGET_PROMPT, target_params())
    assert sorted(built) == ["ids", "words"]  # at add_request, once for both samples
    built.clear()
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert built == []  # no step built any
    kept = [result_of(done["masked"], i) for i in range(2)]
    assert all(len(r.token_ids) == 10 and not set(r.token_ids) & set(range(100, 140)) for r in kept)
    monkeypatch.setattr(P.RequestMaskIds, "build", lambda self, V: self)  # rows build theirs per step
    from detent.scheduler.request import Request
    monkeypatch.setattr(Request, "mask_ids", property(lambda self: None, lambda self, masks: None), raising=False)
    fresh = llm.generate([{"prompt_token_ids": TARGET_PROMPT[:9]}], [masked], use_tqdm=False)[0]
    assert all(same(a, result_of(fresh, i)) for i, a in enumerate(kept))
    assert len(built) > 10  # the comparison's rows did build theirs at each step


def test_params_a_server_checked_are_admitted_without_being_walked_again(monkeypatch):
    """detent-serve's engine admits a request between two steps, on its step thread, where checks
    that read only the request paused every running request (a legal 64 KB schema's walk took 12 ms,
    a vocabulary's allowed ids, bias and stop ids 9 ms); the server had made them on its worker pool.
    Params checked there (`checked_params`), pickled as the engine core receives them, are admitted
    without them. Params the engine has not seen checked (offline, a replace()d copy, another
    vocabulary's) are checked at admission as before; a bad one is refused there."""
    import dataclasses
    import pickle

    from detent.engine import admission, checked_params
    from detent.sampling import grammar
    calls = []
    real_vocab, real_limits = SamplingParams.verify_vocab, admission.check_limits
    monkeypatch.setattr(SamplingParams, "verify_vocab", lambda self, V: calls.append("vocab") or real_vocab(self, V))
    for module in (admission, grammar):  # admission's check, and the grammar cache's
        monkeypatch.setattr(module, "check_limits", lambda spec, *a: calls.append("limits") or real_limits(spec, *a))
    eng = tiny_llm(VOCAB).llm_engine

    def params() -> SamplingParams:
        return SamplingParams(n=3, max_tokens=3, stop_token_ids=list(range(100, VOCAB)), logit_bias={5: 1.0},
                              structured_outputs=StructuredOutputs(json={"type": "object"}))
    served = pickle.loads(pickle.dumps(checked_params(params(), VOCAB)))
    assert calls == ["vocab"]  # on the caller's thread (the grammar limits too: processors' own name)
    calls.clear()
    eng.add_request("served", [3, 4], served)
    assert calls == []
    unchecked = [params(), dataclasses.replace(served), checked_params(params(), VOCAB + 1)]
    calls.clear()
    for i, p in enumerate(unchecked):
        eng.add_request(f"offline{i}", [3, 4], p)
        assert calls == ["vocab", "limits", "limits"], (i, calls)  # admission's, the cache's once for n = 3
        calls.clear()
    with pytest.raises(ValueError, match="token id 200, outside the vocabulary"):
        eng.add_request("bad", [3], checked_params(SamplingParams(stop_token_ids=[200]), 300))
    eng.withdraw_requests(["served", "offline0", "offline1", "offline2"])
    assert not eng.has_unfinished_requests()


def test_a_served_requests_bad_words_come_indexed_and_sample_the_same_bits(monkeypatch):
    """100k bad words took 33 ms to index at admission, which detent-serve's engine makes between
    two steps on its step thread: every running request waited. The server indexes them on its
    worker pool (`checked_params`), and the index travels with the params to the engine core, which
    builds none. The tokens and logprobs are those of the same params indexed at admission (n = 2)."""
    import pickle

    from detent.engine import checked_params
    from detent.sampling import processors as P
    built, real = [], P.BadWords.__init__  # the class itself stays: the index is pickled
    monkeypatch.setattr(P.BadWords, "__init__", lambda self, words, V: built.append(V) or real(self, words, V))
    words = [[t] for t in range(100, 140)] + [[t, t + 1] for t in range(2, 100)] + [[7, 8, 9]]

    def params() -> SamplingParams:
        return SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, logprobs=2, ignore_eos=True,
                              bad_words_token_ids=words)
    served = pickle.loads(pickle.dumps(checked_params(params(), VOCAB)))
    assert built == [VOCAB]  # on the caller's thread
    built.clear()
    llm = tiny_llm(VOCAB)
    got = llm.generate([{"prompt_token_ids": TARGET_PROMPT[:9]}], [served], use_tqdm=False)[0]
    assert built == []
    want = llm.generate([{"prompt_token_ids": TARGET_PROMPT[:9]}], [params()], use_tqdm=False)[0]
    assert built == [VOCAB]  # unchecked params: indexed at admission
    assert all(same(result_of(got, i), result_of(want, i)) for i in range(2))
    assert all(not set(c.token_ids) & set(range(100, 140)) for c in got.outputs)


def test_a_served_requests_mask_tables_come_built_and_checked_and_sample_the_same_bits(monkeypatch):
    """A vocabulary's allowed ids, bias and stop ids took 14 ms on detent-serve's step thread to build
    into the request's mask tables (`build_mask_ids`) and to check that they leave some token (set
    operations over every id), a pause of every running request. Given the engine's EOS ids, the
    server's worker pool does both (`checked_params`) and the tables travel with the params: the
    engine builds and checks none. Tokens and logprobs (n = 2) are those of the same params built at
    admission; params checked for other EOS ids are built and checked there, and a request whose bans
    leave no token is refused on the pool."""
    import pickle

    from detent.engine import checked_params
    from detent.sampling import processors as P
    llm = tiny_llm(VOCAB)
    eng = llm.llm_engine

    def params() -> SamplingParams:
        return SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, logprobs=2, ignore_eos=True, min_tokens=4,
                              allowed_token_ids=list(range(2, 120)), stop_token_ids=list(range(100, VOCAB)),
                              logit_bias={t: t % 7 - 3.0 for t in range(VOCAB)}, bad_words_token_ids=[[5], [6, 7]])
    served = pickle.loads(pickle.dumps(checked_params(params(), VOCAB, eng.eos_token_ids)))
    calls = []
    real = {"build_mask_ids": P.build_mask_ids, "setdiff1d": np.setdiff1d, "union1d": np.union1d}
    monkeypatch.setattr(P, "build_mask_ids", lambda *a: calls.append("build_mask_ids") or real["build_mask_ids"](*a))
    for name in ("setdiff1d", "union1d"):  # check_some_token_left's set operations
        monkeypatch.setattr(np, name, lambda *a, _n=name, **k: calls.append(_n) or real[_n](*a, **k))
    eng.add_request("served", TARGET_PROMPT[:9], served)
    assert calls == []
    eng.add_request("other-eos", TARGET_PROMPT[:9], checked_params(params(), VOCAB, (0,)))
    assert calls[0] == "build_mask_ids" and "setdiff1d" in calls, calls
    eng.withdraw_requests(["served", "other-eos"])
    got = llm.generate([{"prompt_token_ids": TARGET_PROMPT[:9]}], [served], use_tqdm=False)[0]
    want = llm.generate([{"prompt_token_ids": TARGET_PROMPT[:9]}], [params()], use_tqdm=False)[0]
    assert all(same(result_of(got, i), result_of(want, i)) for i in range(2))
    assert all(set(c.token_ids) <= set(range(2, 120)) - {5} for c in got.outputs)
    with pytest.raises(ValueError, match="min_tokens=1 bans EOS and stop_token_ids"):
        checked_params(SamplingParams(min_tokens=1, allowed_token_ids=[9], stop_token_ids=[9]), VOCAB, eng.eos_token_ids)


def test_a_requests_grammar_key_is_made_once_and_a_served_ones_on_the_servers_pool(monkeypatch):
    """The grammar cache finds a compiled spec by its canonical JSON (`StructuredOutputs.key`), which
    admission made for every sample, on detent-serve's step thread: 0.5 ms for a legal 64 KB schema,
    69 ms for n = 128. A server's worker makes it (`checked_params`) and it travels with the params;
    offline params' is made once for all their samples. Both find the one compiled grammar."""
    import pickle

    from detent.engine import checked_params
    keys, real = [], StructuredOutputs.key
    monkeypatch.setattr(StructuredOutputs, "key", lambda self: keys.append(1) or real(self))
    eng = tiny_llm(VOCAB).llm_engine

    def params() -> SamplingParams:
        return SamplingParams(n=3, max_tokens=3, structured_outputs=StructuredOutputs(json={"type": "object"}))
    served = pickle.loads(pickle.dumps(checked_params(params(), VOCAB)))
    assert len(keys) == 1  # on the caller's thread
    keys.clear()
    eng.add_request("served", [3, 4], served)
    assert keys == []
    eng.add_request("offline", [3, 4], params())
    assert len(keys) == 1
    assert (eng._grammars.misses, eng._grammars.hits) == (1, 5)  # one compile for the six samples
    eng.withdraw_requests(["served", "offline"])


def test_a_requests_samples_hash_its_prompt_once(monkeypatch):
    """Each of a request's n samples hashed the whole prompt for the prefix cache, on detent-serve's
    step thread: a 32k-token prompt took 6.5 ms a sample, 0.85 s for n = 128, a pause of every running
    request. The first sample hashes it, the others take its hashes (and its prompt list); each keeps
    its own hashes as its outputs grow. Tokens and logprobs are those of samples that each hash it."""
    from detent.scheduler import request as R
    calls, real = [], R.hash_blocks
    monkeypatch.setattr(R, "hash_blocks", lambda ids, *a, **k: calls.append(len(ids)) or real(ids, *a, **k))
    llm = tiny_llm(VOCAB)
    eng = llm.llm_engine
    eng.add_request("n4", TARGET_PROMPT, target_params(n=4, max_tokens=8))
    eng.step()
    samples = eng.outputs.children("n4")
    assert calls == [len(TARGET_PROMPT)]
    assert all(s.block_hashes == real(TARGET_PROMPT, s.block_size) for s in samples)
    assert samples[1].prompt_token_ids is samples[0].prompt_token_ids
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert all(s.block_hashes == real(s.all_token_ids, s.block_size) for s in samples)
    monkeypatch.setattr(R.Request, "__init__", _unshared(R.Request.__init__))
    alone = llm.generate([{"prompt_token_ids": TARGET_PROMPT}], target_params(n=4, max_tokens=8), use_tqdm=False)[0]
    assert all(same(result_of(done["n4"], i), result_of(alone, i)) for i in range(4))


def _unshared(init):
    """Request.__init__ that takes nothing from a sibling: each sample hashes its prompt, as before."""
    def made_alone(self, *a, sibling=None, **k):
        init(self, *a, **k)
    return made_alone


def test_a_prompt_hashed_on_a_servers_pool_is_not_hashed_again_unless_for_another_block_size(monkeypatch):
    """A prompt a server's pool hashed for the engine's block size (`HashedPrompt`, pickled as the
    core's pipe carries it) is not hashed again at admission: its samples take its hashes, the same
    as the engine's own. One hashed for another block size, or a plain list (offline), is hashed there."""
    import pickle

    from detent.engine import HashedPrompt
    from detent.scheduler import request as R
    calls, real = [], R.hash_blocks
    monkeypatch.setattr(R, "hash_blocks", lambda ids, *a, **k: calls.append(len(ids)) or real(ids, *a, **k))
    eng = tiny_llm(VOCAB).llm_engine
    bs = eng.limits().block_size
    for rid, prompt, hashed in (("served", HashedPrompt.of(TARGET_PROMPT, bs), False),
                                ("other size", HashedPrompt.of(TARGET_PROMPT, bs // 2), True),
                                ("offline", TARGET_PROMPT, True)):
        calls.clear()
        eng.add_request(rid, pickle.loads(pickle.dumps(prompt)), target_params(n=3, max_tokens=2))
        eng.step()
        assert calls == ([len(TARGET_PROMPT)] if hashed else []), rid
        samples = eng.outputs.children(rid)
        assert all(s.block_hashes[:len(TARGET_PROMPT) // bs] == real(TARGET_PROMPT, bs) for s in samples), rid
        assert samples[1].prompt_token_ids is samples[0].prompt_token_ids
        eng.withdraw_requests([rid])

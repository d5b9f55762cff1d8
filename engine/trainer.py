"""Trainer forward: per-token logprobs of full sequences (prompt + completion)
under the same (model, deployment, tuple) as the rollouts.

It runs the engine's model with the engine's dispatcher through the same
runner code (prompt-logprob path) on a scratch KV cache, so with
selection="pinned" every logprob equals, bit for bit, the one the engine
reported when it sampled that token — whatever the rollout's batch,
chunking, prefix hits or preemptions were. (This is the scoring pass; `engine/train_model.py`'s TrainerModel is the
same forward with gradients.)

    tf = TrainerForward(llm)
    lps = tf.logprobs([prompt_ids + out.outputs[0].token_ids])[0]   # [len - 1] fp32
    lps[len(prompt_ids) - 1:]  == the rollout's chosen-token logprobs
"""
from __future__ import annotations

from typing import Sequence

import torch

from detent.engine.kv_cache import KVCacheSpec, allocate_kv_caches
from detent.engine.model_runner import ModelRunner
from detent.scheduler.outputs import ScheduledSeq, SchedulerOutput


def check_sequences(seqs: list[list[int]], max_model_len: int, vocab: int) -> None:
    """Sequences a scoring pass accepts: 2 .. max_model_len tokens, ids in the vocabulary."""
    for j, s in enumerate(seqs):
        if len(s) < 2:
            raise ValueError(f"sequence {j} has {len(s)} tokens: scoring needs at least 2")
        if len(s) > max_model_len:
            raise ValueError(f"sequence {j} has {len(s)} tokens, more than max_model_len={max_model_len}")
        if not all(0 <= t < vocab for t in s):
            raise ValueError(f"sequence {j} has token ids outside the vocabulary [0, {vocab})")


class TrainerForward:
    def __init__(self, llm_or_engine):
        eng = getattr(llm_or_engine, "llm_engine", llm_or_engine)
        if not isinstance(eng.runner, ModelRunner):
            raise NotImplementedError("TrainerForward needs a single-process engine (tensor_parallel_size=1)")
        self.engine = eng
        self.max_tokens = eng.config.max_num_batched_tokens

    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each sequence x, a float32 tensor [len(x) - 1] whose entry i is
        log p(x[i + 1] | x[:i + 1])."""
        seqs = [list(map(int, s)) for s in sequences]
        check_sequences(seqs, self.engine.state.max_model_len, self.engine.model_config.vocab_size)
        out, g = [], self.engine.config.max_num_seqs
        for i in range(0, len(seqs), g):  # a scratch KV cache per group of sequences
            out += self._score(seqs[i:i + g])
        return out

    def _score(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Prefill the sequences in chunks under the engine's token budget
        (the dispatcher's selectors assume it), scoring every row."""
        eng = self.engine
        bs = eng.config.block_size
        mc = eng.model_config
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.state.dtype, bs)
        need = [-(-len(s) // bs) for s in seqs]
        caches = allocate_kv_caches(spec, sum(need) + 1, eng.state.device)  # block 0: null
        runner = ModelRunner(eng.runner.model, caches, bs, eng.dispatcher, eng.state.device)
        tables, first = [], 1
        for n in need:
            tables.append(tuple(range(first, first + n)))
            first += n
        done = [0] * len(seqs)
        rows: list[list[float]] = [[] for _ in seqs]
        while any(d < len(s) for d, s in zip(done, seqs)):
            budget, planned = self.max_tokens, []
            for i, s in enumerate(seqs):
                if done[i] == len(s) or budget == 0:
                    continue
                n = min(len(s) - done[i], budget)
                lo, hi = done[i], min(done[i] + n, len(s) - 1)
                planned.append(ScheduledSeq(str(i), tuple(s[lo:lo + n]), lo, tables[i], None,
                                            prompt_logprobs_k=0, prompt_rows_start=lo,
                                            prompt_targets=tuple(s[lo + 1:hi + 1])))
                done[i] += n
                budget -= n
            res = runner.execute(SchedulerOutput(tuple(planned), self.max_tokens - budget))
            for q in planned:
                if q.prompt_targets:
                    rows[int(q.request_id)] += [r[0] for r in res.prompt_logprobs[q.request_id]]
        return [torch.tensor(r, dtype=torch.float32) for r in rows]

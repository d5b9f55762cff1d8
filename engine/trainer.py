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

from detent.engine.inputs import token_id_list
from detent.engine.kv_cache import KVCacheSpec, allocate_kv_caches
from detent.engine.model_runner import ModelRunner
from detent.scheduler.outputs import ScheduledSeq, SchedulerOutput


def as_sequences(sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """`sequences` (a list of token-id lists) as lists of ints, or a ValueError naming
    the entry (a str's characters and a float's truncation are not token ids)."""
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__iter__"):
        raise ValueError(f"sequences must be a list of token-id lists, got {type(sequences).__name__}")
    return [token_id_list(f"sequences[{j}]", s) for j, s in enumerate(sequences)]


def check_sequences(seqs: list[list[int]], max_model_len: int, vocab: int) -> None:
    """Sequences a scoring pass accepts: 2 .. max_model_len tokens, ids in the vocabulary."""
    for j, s in enumerate(seqs):
        if len(s) < 2:
            raise ValueError(f"sequence {j} has {len(s)} tokens: scoring needs at least 2")
        if len(s) > max_model_len:
            raise ValueError(f"sequence {j} has {len(s)} tokens, more than max_model_len={max_model_len}")
        if not all(0 <= t < vocab for t in s):
            raise ValueError(f"sequence {j} has token ids outside the vocabulary [0, {vocab})")


def plan_chunks(lengths: list[int], budget: int) -> list[list[tuple[int, int, int]]]:
    """Steps of a scoring pass over sequences of `lengths`, cut the way
    chunked prefill cuts prompts: each step takes up to `budget` tokens, in
    sequence order, as (sequence index, first position, number of tokens).
    A sequence longer than the budget spans steps; a later chunk attends to
    the KV its earlier chunks wrote. The cuts need not be the rollout's:
    under pinned selection no bit depends on them."""
    steps, done = [], [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        left, step = budget, []
        for i, n in enumerate(lengths):
            if done[i] == n or left == 0:
                continue
            take = min(n - done[i], left)
            step.append((i, done[i], take))
            done[i] += take
            left -= take
        steps.append(step)
    return steps


def scratch_tables(lengths: list[int], block_size: int) -> tuple[int, list[tuple[int, ...]]]:
    """Block tables for a scratch KV cache holding every sequence whole
    (block 0 is the null block): (number of blocks, tables)."""
    tables, first = [], 1
    for n in lengths:
        nb = -(-n // block_size)
        tables.append(tuple(range(first, first + nb)))
        first += nb
    return first, tables


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
        seqs = as_sequences(sequences)
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
        num_blocks, tables = scratch_tables([len(s) for s in seqs], bs)
        caches = allocate_kv_caches(spec, num_blocks, eng.state.device)
        runner = ModelRunner(eng.runner.model, caches, bs, eng.dispatcher, eng.state.device)
        rows: list[list[float]] = [[] for _ in seqs]
        for step in plan_chunks([len(s) for s in seqs], self.max_tokens):
            planned = []
            for i, lo, n in step:
                s = seqs[i]
                planned.append(ScheduledSeq(str(i), tuple(s[lo:lo + n]), lo, tables[i], None,
                                            prompt_logprobs_k=0, prompt_rows_start=lo,
                                            prompt_targets=tuple(s[lo + 1:min(lo + n, len(s) - 1) + 1])))
            res = runner.execute(SchedulerOutput(tuple(planned), sum(n for _, _, n in step)))
            for q in planned:
                if q.prompt_targets:
                    rows[int(q.request_id)] += [r[0] for r in res.prompt_logprobs[q.request_id]]
        return [torch.tensor(r, dtype=torch.float32) for r in rows]

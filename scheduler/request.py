"""A request's state as counters, not phase flags.

Everything else is derived: a request is in prefill while
``num_computed_tokens < num_tokens - 1``; it samples a token in a step that
brings ``num_computed_tokens`` up to ``num_tokens``. Tokens are appended
through one method, `append_output_token`, which also extends the block
hashes of the prefix cache. Preemption (by recompute) only resets
``num_computed_tokens`` and the block ids: prompt, outputs and hashes stay.
"""
from __future__ import annotations

import enum
import functools
import time
from typing import Any, Sequence

import numpy as np

from detent.scheduler.block_hash import NONE_HASH, BlockHash, HashedPrompt, hash_blocks
from detent.sampling.params import SamplingParams
from detent.sampling.processors import RequestMaskIds


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 *, seed: int, block_size: int, sample_index: int = 0, extra_keys: tuple = (),
                 eos_token_ids: Sequence[int] = (), mask_ids: RequestMaskIds | None = None,
                 sibling: Request | None = None, prompt_hashes: HashedPrompt | None = None):
        self.request_id = request_id
        self.params = params
        self.seed = seed  # params.seed, or one drawn at admission (kept for replay)
        self.sample_index = sample_index
        self.block_size = block_size
        self.extra_keys = tuple(extra_keys)
        self.eos_token_ids = frozenset(eos_token_ids)
        # the token ids its request masks write (allowed ids, logit_bias, the ids min_tokens bans,
        # bad words' index), kept for every step: they can be a vocabulary's worth, too many to
        # gather from the parameters' lists every step. The engine gives them built
        # (RequestMaskIds.build at add_request); else its first masked step builds them
        self.mask_ids = mask_ids or RequestMaskIds(params, self.eos_token_ids)
        # `sibling`: another sample of the request, made before it (the engine makes a request's n
        # samples together, on its step thread): its prompt list (read-only) and the prompt's block
        # hashes are taken, not made again (a 32k-token prompt's took 6.5 ms a sample, 0.85 s for n = 128)
        self.prompt_token_ids: list[int] = sibling.prompt_token_ids if sibling is not None else list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._outputs = np.empty(0, dtype=np.int64)  # output_token_ids' numpy mirror (output_array)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in block_ids (or is being written by a launched step)
        self.num_pending = 0  # tokens sampled by launched steps, not yet seen by the host
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (-1: not yet scheduled)
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        hashes = None
        if sibling is not None:
            hashes = sibling.block_hashes[:self.num_prompt_tokens // block_size]
        elif prompt_hashes is not None:  # made on a server's pool; None unless this prompt's, size's and keys'
            hashes = prompt_hashes.hashes_for(self.prompt_token_ids, block_size, self.extra_keys)
        self.block_hashes: list[BlockHash] = (
            hashes if hashes is not None else hash_blocks(self.all_token_ids, block_size, self.extra_keys))
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.grammar: Any = None  # per-request grammar state (sampling issue), or None
        # per output token: (chosen logprob, rank, topk ids, topk logprobs)
        self.output_logprobs: list[tuple[float, int, list[int], list[float]]] = []
        # per prompt position 1..P-1: (logprob of the prompt token, rank, topk ids, topk logprobs)
        self.prompt_logprobs: list[tuple[float, int, list[int], list[float]]] = []
        # prompt rows planned for prompt logprobs so far: under async scheduling a chunk's rows
        # may still be on the device, so a recompute (preemption) starts after these, not after
        # the rows that have come back
        self.num_prompt_logprobs_planned = 0
        # engine-clock timestamps (time.monotonic) for the server's metrics: queued, first
        # scheduled, first and latest token (vLLM's QUEUED / SCHEDULED / NEW_TOKENS events)
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    # ------------------------------------------------------------ derived
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def needs_token_feedback(self, grammar_after_launch: bool) -> bool:
        """Its next step cannot be planned before the host has its last token: a
        grammar advances on it (on the host), unless the runner samples grammar
        rows after the launch (`grammar_after_launch`: the step's forward is
        queued first, and its sampling once the token has advanced the
        grammar). (Penalties, min_tokens, bad words and golden tokens read the
        output so far, and take its pending last token from the device:
        SamplingRow.pending. Prompt logprobs come back with their step, and the
        next chunk's rows start where the planned ones end.)"""
        return self.grammar is not None and not grammar_after_launch

    @functools.cached_property
    def prompt_array(self) -> np.ndarray:
        """The prompt as int64 numpy, made once: the sampler reads a repetition-penalised
        row's prompt every step, and a copy from numpy costs a fraction of one from a list."""
        a = np.asarray(self.prompt_token_ids, dtype=np.int64)
        a.flags.writeable = False
        return a

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """params.stop_token_ids as a set, made once: `Scheduler.update` looks each new token
        up in it, and a list of 49k ids costs a scan a step."""
        return frozenset(self.params.stop_token_ids)

    @functools.cached_property
    def allowed_token_set(self) -> frozenset[int] | None:
        """params.allowed_token_ids as a set, made once (None: every token allowed): `Scheduler.update`
        checks a grammar request's sampled tokens against it."""
        ids = self.params.allowed_token_ids
        return frozenset(ids) if ids else None

    @property
    def output_array(self) -> np.ndarray:
        """The outputs so far as int64 numpy (a view of a buffer `append_output_token`
        grows; it keeps its values when later tokens are appended), for the same reason."""
        return self._outputs[:len(self.output_token_ids)]

    @property
    def golden_token(self) -> int | None:
        """The teacher-forced token for the position about to be planned, if any: the
        output's next one after those the host has and the one still pending."""
        g = self.params.golden_token_ids
        k = self.num_output_tokens + self.num_pending
        if g is not None and k < len(g):
            return g[k]
        return None

    # ------------------------------------------------------------ the one mutator of tokens
    def append_output_token(self, token_id: int) -> None:
        n = len(self.output_token_ids)
        if n == len(self._outputs):  # a new buffer: views already handed out keep the old one
            self._outputs = np.concatenate([self._outputs, np.empty(max(16, n), dtype=np.int64)])
        self._outputs[n] = token_id
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time
        n = len(self.block_hashes)
        if self.num_tokens // self.block_size > n:
            parent = self.block_hashes[-1] if n else NONE_HASH
            self.block_hashes += hash_blocks(self.all_token_ids, self.block_size, self.extra_keys,
                                             parent=parent, start_block=n)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_ids})")

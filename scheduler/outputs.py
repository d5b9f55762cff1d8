"""The plain frozen records the scheduler and the model runner hand each
other, frozen at the boundary. No tensors here, so a step's plan can be sent to
tensor-parallel workers as it is."""
from __future__ import annotations

from dataclasses import dataclass

from detent.sampling.sampler import SamplingRow


PLACEHOLDER = -1  # an input token the previous (still running) step samples; filled on the device


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute `token_ids` at positions
    ``start .. start + len(token_ids) - 1`` into the KV slots of `block_ids`."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int  # num_computed_tokens before this step
    block_ids: tuple[int, ...]  # the request's block table after allocation
    sample: SamplingRow | None  # the last row samples the next token (None: prefill chunk)
    # prompt logprobs of this chunk: rows at positions prompt_rows_start ..
    # prompt_rows_start + len(prompt_targets) - 1, each scored on the next
    # prompt token; k is the top-k size. Empty when not requested.
    prompt_logprobs_k: int = 0
    prompt_rows_start: int = 0
    prompt_targets: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()
    # requests finished since the plan run before, for a runner that keeps state per request (a
    # tensor-parallel rank keeps a request's sampling parameters: engine/tp/plan.py)
    finished_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs


# (logprob of the token, its rank, top-k ids, top-k logprobs)
TokenLogprobs = tuple[float, int, tuple[int, ...], tuple[float, ...]]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs


@dataclass(frozen=True)
class ModelOutput:
    sampled: dict[str, SampledToken]  # request id -> the token sampled this step
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]]  # request id -> this chunk's rows

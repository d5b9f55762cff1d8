"""Request outputs with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 + number of tokens with a strictly larger logprob
    decoded_token: str | None = None


# per position: token id -> Logprob (the chosen/prompt token first, then the top-k)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    seed: int | None = None  # the seed the request sampled with (params.seed or drawn at admission)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """The engine's timestamps (its time.monotonic(); one clock per host, so a
    server process on the same machine can subtract its own readings)."""
    arrival_time: float  # queued in the engine
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first scheduled (preemptions do not move it)
    last_token_time: float | None = None  # the latest token of any sample


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

"""The bounds on what one request may ask of the server (all `detent-serve` flags).

Each bound exists so that one client cannot take the server from the
others: a body the server waits on forever, a prompt tokenized for seconds
before its length is known, a template that loops, a response of hundreds
of megabytes. A request over a bound gets a 4xx naming the bound and its
flag; docs/server.md lists them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# JSON nesting deeper than this is refused before validation (a 100,000-deep
# body was a RecursionError). Real bodies (schemas included) stay far below.
MAX_JSON_DEPTH = 64
# Every JSON integer must fit 64 bits (signed or unsigned: seeds use both);
# larger ones overflowed inside torch.
JSON_INT_MIN, JSON_INT_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 16 << 20      # --max-request-bytes: larger bodies get 413
    request_timeout_s: float = 30.0        # --request-timeout: a body not received by then gets 408
    max_prompts: int = 64                  # --max-prompts-per-request: prompts in one /v1/completions body
    max_n: int = 128                       # --max-n: samples per prompt (n, best_of)
    max_sequences: int = 256               # --max-sequences-per-request: prompts x n
    max_logprob_entries: int = 1_000_000   # --max-logprob-entries: logprob values one response may hold
    chars_per_token: int = 32              # --max-chars-per-token: prompt chars allowed per context token
    chat_template_timeout_s: float = 5.0   # --chat-template-timeout: rendering time of one conversation
    trust_request_chat_template: bool = False  # --trust-request-chat-template: allow client templates
    preprocess_workers: int = 4            # --preprocess-workers: threads that tokenize and render
    max_verify_records: int = 16           # --max-verify-records: request records in one POST /v1/verify body

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type != "bool" and not v > 0:
                raise ValueError(f"server limit {f.name} must be positive, got {v!r}")

    def max_prompt_chars(self, max_model_len: int) -> int:
        """Characters a prompt may have before it is tokenized: a prompt that fits
        the context has at most this many unless its tokens average over
        `chars_per_token` characters, which no real tokenizer's text does."""
        return max_model_len * self.chars_per_token

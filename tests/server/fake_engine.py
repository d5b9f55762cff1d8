"""TEST DOUBLE: a tiny fake engine and byte-level tokenizer with the real
engine's interface (`add_request`, `step`, `abort_request`,
`has_unfinished_requests`, `stats`), for in-process unit tests of the
`AsyncEngine` thread (aborts, refusals, engine death) in test_units.py. It
is not a model: its "tokens" are a hash of (seed, position, sample index).
Every HTTP test (test_api, test_errors, test_lifecycle) runs the real
engine in a real `detent-serve` process.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from detent.engine.outputs import CompletionOutput, Logprob, RequestOutput

BOS, EOS = 0, 1
OFFSET = 3


class FakeTokenizer:
    vocab_size = 256 + OFFSET
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + OFFSET for b in text.encode("utf-8")]
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i >= OFFSET:
                out.append(i - OFFSET)
            elif not skip_special_tokens:
                out += b"<s>" if i == BOS else b"</s>" if i == EOS else b"<pad>"
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        s = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        return s + ("<|assistant|>" if add_generation_prompt else "")


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: object
    arrival: float
    outs: list[list[int]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    blocks: int = 0


class FakeEngine:
    def __init__(self, max_num_seqs: int = 8, num_blocks: int = 256, block_size: int = 4,
                 max_model_len: int = 512, step_s: float = 0.002):
        self.max_num_seqs, self.num_blocks, self.block_size = max_num_seqs, num_blocks, block_size
        self.max_model_len, self.vocab_size, self.step_s = max_model_len, FakeTokenizer.vocab_size, step_s
        self.tok = FakeTokenizer()
        self.waiting: list[_Req] = []
        self.running: dict[str, _Req] = {}
        self.used_blocks = 0
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt_token_ids, sampling_params) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens is over max_model_len={self.max_model_len}")
        self.waiting.append(_Req(request_id, list(prompt_token_ids), sampling_params, time.time()))

    def abort_request(self, request_id) -> None:
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        r = self.running.pop(request_id, None)
        if r is not None:
            self.used_blocks -= r.blocks
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        return {"num_waiting": len(self.waiting), "num_running": len(self.running),
                "num_total_blocks": self.num_blocks, "num_free_blocks": self.num_blocks - self.used_blocks,
                "prefix_cache_hit_rate": 0.0}

    def _token(self, r: _Req, j: int, pos: int) -> int:
        seed = r.params.seed if r.params.seed is not None else 0
        h = hashlib.sha256(f"{seed}/{j}/{pos}/{r.prompt[-3:]}".encode()).digest()
        return OFFSET + 97 + h[0] % 26  # a..z

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            r.outs = [[] for _ in range(r.params.n)]
            r.reasons = [None] * r.params.n
            self.running[r.rid] = r
        results = []
        for r in list(self.running.values()):
            for j, toks in enumerate(r.outs):
                if r.reasons[j] is None:
                    toks.append(self._token(r, j, len(r.prompt) + len(toks)))
                    text = self.tok.decode(toks)
                    if any(s in text for s in r.params.stop):
                        r.reasons[j] = "stop"
                    elif len(toks) >= r.params.max_tokens:
                        r.reasons[j] = "length"
            need = -(-(len(r.prompt) + max(len(t) for t in r.outs)) // self.block_size) * len(r.outs)
            self.used_blocks += need - r.blocks
            r.blocks = need
            finished = all(x is not None for x in r.reasons)
            results.append(self._output(r, finished))
            if finished:
                del self.running[r.rid]
                self.used_blocks -= r.blocks
        return results

    def _output(self, r: _Req, finished: bool) -> RequestOutput:
        outs = []
        k = r.params.logprobs
        for j, toks in enumerate(r.outs):
            text = self.tok.decode(toks)
            stop_reason = None
            if r.reasons[j] == "stop":
                s = next(s for s in r.params.stop if s in text)
                text, stop_reason = text[: text.index(s)], s
            lps = None
            if k is not None:
                lps = [{t: Logprob(-0.25, 1), **{OFFSET + 97 + (t + i) % 26: Logprob(-1.0 - i, 2 + i)
                                                  for i in range(1, k + 1)}} for t in toks]
            outs.append(CompletionOutput(index=j, text=text, token_ids=list(toks), cumulative_logprob=None,
                                         logprobs=lps, finish_reason=r.reasons[j], stop_reason=stop_reason,
                                         seed=r.params.seed))
        return RequestOutput(request_id=r.rid, prompt=None, prompt_token_ids=list(r.prompt),
                             prompt_logprobs=None, outputs=outs, finished=finished)


def fake_state(engine=None, tokenizer=None, **kw):
    """A `ServerState` over `engine` (a FakeEngine by default) and `tokenizer` (a FakeTokenizer),
    serving model "m" with a 512-token context and fixed hashes; `kw`: the other fields."""
    from detent.server.async_engine import AsyncEngine
    from detent.server.serving import ServerState
    return ServerState(engine=AsyncEngine(engine or FakeEngine()), tokenizer=tokenizer or FakeTokenizer(),
                       served_model_names=kw.pop("served_model_names", ["m"]), model_root="x", max_model_len=512,
                       tuple_hash="a" * 64, deployment_hash="b" * 64, **kw)

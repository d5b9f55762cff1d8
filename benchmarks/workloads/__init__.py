"""The serving workloads of docs/performance.md ("Workloads"), as data:
seeded, synthetic requests with prompt token ids, plus the loads each
workload runs at (fractions of stock's maximum throughput, or a closed loop).

    from detent.workloads import make
    w = make("W-A")                        # 600 chat turns from 160 conversations
    w.requests[3].prompt_token_ids, w.requests[3].max_tokens, w.requests[3].after
    [l.name for l in w.loads]              # ['A1', 'A2', 'A3', 'A4']

This folder (benchmarks/workloads/) is installed as `detent.workloads` so
that `detent tune --workload W-A` can profile the same requests the
benchmarks send (benchmarks/workload_client.py over HTTP). It imports
nothing of ours. README.md here describes each workload.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

NAMES = ("W-A", "W-B", "W-C")
VOCAB = 32000  # prompt ids are drawn in [FIRST_ID, vocab): below every supported model's vocabulary
FIRST_ID = 10  # above the special tokens of the usual tokenizers


@dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # sent with ignore_eos: the output length is exact
    after: int | None = None  # index of the request that must finish first (a chat's previous turn)


@dataclass(frozen=True)
class Load:
    name: str  # "A1"
    fraction: float | None = None  # Poisson arrivals at this fraction of stock's maximum request throughput
    concurrency: int | None = None  # or: a closed loop with this many requests in flight

    def __post_init__(self):
        if (self.fraction is None) == (self.concurrency is None):
            raise ValueError(f"load {self.name}: give exactly one of fraction and concurrency")


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    loads: tuple[Load, ...]
    seed: int

    @property
    def prefix_reuse(self) -> float:
        """Share of prompt tokens that repeat the previous turn's prompt (what a prefix cache can hit)."""
        total = sum(len(r.prompt_token_ids) for r in self.requests)
        reused = sum(len(self.requests[r.after].prompt_token_ids) for r in self.requests if r.after is not None)
        return reused / total if total else 0.0

    def rounds(self) -> list[list[int]]:
        """Request indices grouped so that each one's `after` is in an earlier group (offline replay)."""
        depth: list[int] = []
        for r in self.requests:
            depth.append(0 if r.after is None else depth[r.after] + 1)
        out: list[list[int]] = [[] for _ in range(max(depth, default=-1) + 1)]
        for i, d in enumerate(depth):
            out[d].append(i)
        return out

    def head(self, fraction: float) -> "Workload":
        """The first `fraction` of the requests, at least one (a kept turn's earlier turns are kept too)."""
        n = max(1, math.ceil(fraction * len(self.requests)))
        keep = list(range(n))
        return Workload(self.name, tuple(self.requests[i] for i in keep), self.loads, self.seed)


def sharegpt_like(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths with ShareGPT's shape: log-normal prompts
    (median ~200, long tail to 4k) and outputs (median ~180), clipped so
    prompt + output fits 4,096 tokens. Synthetic and seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(min(3500, max(8, rng.lognormvariate(5.3, 1.0))))
        o = int(min(4096 - p, max(4, rng.lognormvariate(5.2, 0.9))))
        out.append((p, o))
    return out


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, vocab) for _ in range(n))


def chat(num_requests: int = 600, seed: int = 0, vocab: int = VOCAB, max_len: int = 4096) -> Workload:
    """W-A: multi-turn chats replayed turn by turn. A conversation has
    1 + Poisson(2.75) turns (600 requests from about 160 conversations); turn
    k + 1's prompt is turn k's prompt, turn k's recorded answer and a new user
    message, so about 64% of the prompt tokens repeat the previous turn. User
    messages and answers have ShareGPT-like log-normal lengths (`sharegpt_like`,
    first message median ~200 tokens; later messages are shorter, median ~60).
    A conversation ends early when its next turn (prompt + answer) could pass `max_len` tokens."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    lens = iter(sharegpt_like(4 * num_requests + 8, seed))
    while len(reqs) < num_requests:
        turns = 1 + _poisson(rng, 2.75)
        p0, _ = next(lens)
        prompt = _ids(rng, min(p0, max_len // 2), vocab)
        prev = None
        for _ in range(turns):
            if len(reqs) == num_requests:
                break
            _, answer = next(lens)
            answer = max(4, min(answer, 512, max_len // 4))
            reqs.append(Request(prompt, answer, prev))
            prev = len(reqs) - 1
            user = int(min(1024, max(4, rng.lognormvariate(4.1, 1.0))))
            nxt = prompt + _ids(rng, answer + user, vocab)  # the recorded answer, then the user's message
            if len(nxt) + min(512, max_len // 4) > max_len:
                break
            prompt = nxt
    loads = tuple(Load(f"A{i + 1}", fraction=f) for i, f in enumerate((0.25, 0.5, 0.75, 1.0)))
    return Workload("W-A", tuple(reqs), loads, seed)


def documents(num_requests: int = 200, seed: int = 0, vocab: int = VOCAB, max_len: int = 8192,
              name: str = "W-B") -> Workload:
    """W-B: long documents asking for short outputs, each request fitting
    `max_len` tokens: 32-128 output tokens (at most a quarter of `max_len`)
    after a document of 0.9-1.0 x (max_len - 128) tokens (7,258-8,064 at
    8k), with Poisson arrivals at 0.33, 0.67 and 1.0 of stock's maximum
    throughput (B1-B3)."""
    rng = random.Random(seed + 1)
    reserve = min(128, max_len // 4)
    reqs = []
    for _ in range(num_requests):
        n = max(4, int((max_len - reserve) * rng.uniform(0.9, 1.0)))
        reqs.append(Request(_ids(rng, n, vocab), min(rng.randrange(32, 129), reserve)))
    loads = tuple(Load(f"B{i + 1}", fraction=f) for i, f in enumerate((0.33, 0.67, 1.0)))
    return Workload(name, tuple(reqs), loads, seed)


def closed_loop(num_requests: int = 64, seed: int = 0, vocab: int = VOCAB, max_len: int = 8192) -> Workload:
    """W-C: the first `num_requests` W-B documents in a closed loop, one and
    eight in flight (C1, C2): latency without queueing."""
    w = documents(num_requests, seed, vocab, max_len, name="W-C")
    return Workload("W-C", w.requests, (Load("C1", concurrency=1), Load("C2", concurrency=8)), seed)


def load_seed(seed: int, load: str) -> int:
    """The prompt seed of one load ("A1" ... "C2") of a run whose workloads have `seed`: each load
    sends its own prompts, drawn like the workload's, so no load hits what an earlier load, or
    the maximum-throughput run (at `seed` itself), left in the prefix cache. Every arm, and
    vLLM, gets the same prompts for the same load. The seeds are 1,000 apart, so no two of a
    run's random streams (a document's is its seed + 1) are the same."""
    return seed + 1000 * (10 * "ABC".index(load[0]) + int(load[1:]))


def make(name: str, *, num_requests: int | None = None, max_len: int | None = None, seed: int = 0,
         vocab: int = VOCAB) -> Workload:
    """A workload by name (W-A, W-B, W-C), optionally smaller: fewer requests,
    each request (prompt + output) at most `max_len` tokens (default 4,096
    for W-A, 8,192 for W-B and W-C: serve them with that --max-model-len)."""
    kw = {"seed": seed, "vocab": vocab}
    if num_requests is not None:
        kw["num_requests"] = num_requests
    if max_len:
        kw["max_len"] = max_len
    if name == "W-A":
        return chat(**kw)
    if name in ("W-B", "W-C"):
        return (documents if name == "W-B" else closed_loop)(**kw)
    raise ValueError(f"unknown workload {name!r} (workloads: {', '.join(NAMES)})")


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1

"""`detent battery`: run the invariance battery's cells (detent/battery_cells.py)
on one deployment, in process or against a running `detent-serve`, and
compare each cell's target output with the target run alone, with `==`.

In process, every cell runs on ONE engine: the commitment tuple's pins may
depend on deployment facts (budget, page size, ...), so changing those would
compare two deployments, not two batches. The engine's step budget is small
(`max_num_batched_tokens`, default 32) so the target's prefill is chunked,
and a request admitted ahead of it moves the chunk boundaries. The prefix
cache is reset before every cell so only the cell decides what is cached.

Over HTTP, requests of a cell are sent concurrently (the server batches what
is in flight together; the order of sending is the row), and the
prefix-split cells warm the prefix cache with a prefix of the target first.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from detent.battery_cells import (TARGET_MAX_TOKENS, TOP_K, VARIANTS, Cell, Variant, neighbours, prompt,
                                  target_prompt, warm_prompt)

Req = tuple[list[int], int]  # (prompt ids, max_tokens) of a greedy neighbour


@dataclass(frozen=True)
class Bits:
    """What the battery compares: token ids, chosen-token logprobs, and per
    position the top-k as (id, logprob) pairs in rank order."""
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]

    def diff(self, ref: "Bits") -> str | None:
        """None when equal with `==`; else where the first difference is."""
        for what in ("token_ids", "logprobs", "top"):
            a, b = getattr(self, what), getattr(ref, what)
            if a != b:
                i, got, want = first_difference(a, b)
                if isinstance(got, list) and isinstance(want, list):
                    j, got, want = first_difference(got, want)
                    return f"{what}[{i}][{j}]: {got} != alone {want}"
                return f"{what}[{i}]: {got} != alone {want}"
        return None


def first_difference(a: list, b: list) -> tuple[int, Any, Any]:
    """The first index where `a` and `b` differ, and their items there (`<none>` past an end)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return i, a[i] if i < len(a) else "<none>", b[i] if i < len(b) else "<none>"


@dataclass
class CellResult:
    cell: str
    group: str
    condition: str
    passed: bool
    differences: dict[str, str] = field(default_factory=dict)  # variant -> first difference


class OfflineBackend:
    """An `LLM` in this process; a cell's requests go into one `generate` call."""

    split_by_lead = True

    def __init__(self, llm):
        self.llm = llm
        self.vocab = llm.llm_engine.limits().vocab_size
        fp = llm.llm_engine.fingerprint()
        self.fingerprint = {"tuple_hash": fp.tuple_hash, "deployment_hash": fp.deployment_hash}

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def run(self, reqs: list[Req], target: list[int] | None = None, variant: Variant | None = None,
            row: int | None = None) -> Bits | None:
        from detent.engine import SamplingParams
        reqs = list(reqs)
        row = len(reqs) if row is None else row
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        prompts = [p for p, _ in reqs]
        if target is not None:
            prompts.insert(row, target)
            params.insert(row, SamplingParams(temperature=variant.temperature, seed=variant.seed, ignore_eos=True,
                                              max_tokens=TARGET_MAX_TOKENS, logprobs=TOP_K))
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if target is None:
            return None
        c = outs[row].outputs[0]
        top = [ranked((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs]
        return Bits(list(c.token_ids), [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)], top)


class HTTPBackend:
    """A running `detent-serve`: /v1/completions with prompt token ids, sent concurrently."""

    split_by_lead = False

    def __init__(self, url: str, api_key: str | None = None, vocab: int = 1000, timeout: float = 300):
        import httpx
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.vocab = vocab
        self.timeout = timeout
        models = httpx.get(self.url + "/v1/models", headers=self.headers, timeout=timeout)
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]
        self.fingerprint = {"tuple_hash": models.headers.get("x-detent-tuple-hash"),
                            "deployment_hash": models.headers.get("x-detent-deployment-hash")}

    def reset(self) -> None:  # the server's prefix cache stays; cells run after the target hit it
        pass

    def body(self, ids: list[int], max_tokens: int, variant: Variant | None) -> dict[str, Any]:
        b = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
        if variant is not None:
            b.update(temperature=variant.temperature, logprobs=TOP_K, return_tokens_as_token_ids=True)
            if variant.seed is not None:
                b["seed"] = variant.seed
        return b

    def run(self, reqs: list[Req], target: list[int] | None = None, variant: Variant | None = None,
            row: int | None = None) -> Bits | None:
        bodies = [self.body(p, m, None) for p, m in reqs]
        row = len(bodies) if row is None else row
        if target is not None:
            bodies.insert(row, self.body(target, TARGET_MAX_TOKENS, variant))
        answers = asyncio.run(self._send(bodies))
        return None if target is None else bits_of_completion(answers[row]["choices"][0])

    async def _send(self, bodies: list[dict]) -> list[dict]:
        import httpx
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            rs = await asyncio.gather(*[client.post(self.url + "/v1/completions", json=b) for b in bodies])
        for r in rs:
            if r.status_code != 200:
                raise RuntimeError(f"the server answered {r.status_code}: {r.text[:500]}")
        return [r.json() for r in rs]


def ranked(pairs) -> list[tuple[int, float]]:
    """The top-k of a position's (id, logprob) pairs (the chosen token is among
    them even when it ranks lower): highest first, ties to the lower id."""
    return sorted(pairs, key=lambda x: (-x[1], x[0]))[:TOP_K]


def token_id(s: str) -> int:
    return int(s.removeprefix("token_id:"))


def bits_of_completion(choice: dict) -> Bits:
    """Bits of a /v1/completions choice asked with `return_tokens_as_token_ids`."""
    lp = choice["logprobs"]
    top = [ranked((token_id(t), v) for t, v in d.items()) for d in lp["top_logprobs"]]
    return Bits([token_id(t) for t in lp["tokens"]], list(lp["token_logprobs"]), top)


def run_cell(backend, cell: Cell, variant: Variant) -> Bits:
    vocab = backend.vocab
    t = target_prompt(vocab)
    backend.reset()
    if cell.group == "rerun":
        backend.run([(t, TARGET_MAX_TOKENS)])
        if cell.after_traffic:
            backend.run([(prompt(500 + i, 5 + 11 * i, vocab), 8) for i in range(8)])
        else:
            backend.reset()
        return backend.run([], t, variant)
    if cell.lead and backend.split_by_lead:
        return backend.run([(prompt(300 + cell.lead, cell.lead, vocab), 4)], t, variant)
    if cell.prefix:
        backend.run([(warm_prompt(cell, vocab), 1)])
        return backend.run([], t, variant)
    return backend.run(neighbours(cell, vocab), t, variant, row=cell.row)


def run_battery(backend, cells: tuple[Cell, ...], progress=None) -> list[CellResult]:
    refs = {}
    for v in VARIANTS:
        backend.reset()
        refs[v.name] = backend.run([], target_prompt(backend.vocab), v)
    results = []
    for cell in cells:
        diffs = {}
        for v in VARIANTS:
            d = run_cell(backend, cell, v).diff(refs[v.name])
            if d is not None:
                diffs[v.name] = d
        results.append(CellResult(cell.name, cell.group, cell.condition, not diffs, diffs))
        if progress:
            progress(results[-1])
    return results


def table(results: list[CellResult]) -> str:
    w = max(len(r.cell) for r in results)
    lines = [f"{'cell':<{w}}  {'result':<6}  condition"]
    for r in results:
        lines.append(f"{r.cell:<{w}}  {'pass' if r.passed else 'FAIL':<6}  {r.condition}")
        lines += [f"{'':<{w}}          {v}: {d}" for v, d in r.differences.items()]
    n = sum(r.passed for r in results)
    lines.append(f"{n}/{len(results)} cells pass")
    return "\n".join(lines)


def write_json(path: str, results: list[CellResult], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "passed": sum(r.passed for r in results), "total": len(results),
                   "cells": [asdict(r) for r in results]}, f, indent=1)

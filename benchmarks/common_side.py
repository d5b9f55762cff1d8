"""The workload and the measurements that BOTH sides of benchmarks/compare_vllm.py
run, written once so that vLLM and Detent are measured by the same lines.

Standard library only: the vLLM worker imports this module in a process that
must not import Detent (vLLM's bundle brings its own packages).

A side is any object with
    generate(prompts: list[list[int]], max_tokens: int, logprobs: int | None) -> list[output]
where each output has vLLM's shape: `.outputs[0].token_ids` and
`.outputs[0].logprobs` (a list, per generated token, of {token_id: Logprob})
and `.num_cached_tokens`. Sampling is always greedy with ignore_eos.

Prompts are token ids drawn by `random.Random(seed).randrange(10, hi)` with
hi = min(128000, vocab_size), in the same order as vLLM's peer scripts
(the peer bundle's bench.py: seed 0; cells.py: seed 1), so both engines
see the same prompts as those scripts did.
"""
from __future__ import annotations

import random
import statistics
import time

# cells.py's cell names, in its order
CELL_NAMES = ("rerun (warm prefix cache)", "63 short neighbours", "7 long neighbours",
              "shared half prefix neighbour, row 1", "1 neighbour, row 0")


def prompt_hi(vocab_size: int) -> int:
    return min(128000, vocab_size)


def _drawer(seed: int, hi: int):
    rnd = random.Random(seed)
    return lambda n: [rnd.randrange(10, hi) for _ in range(n)]


# ------------------------------------------------------------------ workloads
def decode_workload(batches: list[int], ctx: int, hi: int, seed: int = 0):
    """bench.py's draw order: a 64-token warm-up prompt, then per batch size
    the prompts of the 1-token call and the (fresh) prompts of the long call."""
    P = _drawer(seed, hi)
    warm = P(64)
    return warm, {bs: ([P(ctx) for _ in range(bs)], [P(ctx) for _ in range(bs)]) for bs in batches}


def prefill_workload(lens: list[int], reps: int, hi: int, seed: int = 2):
    """Per length: one warm-up prompt, then `reps` timed prompts (all distinct)."""
    P = _drawer(seed, hi)
    return {n: [P(n) for _ in range(reps + 1)] for n in lens}


def cells_workload(lens: list[int], hi: int, *, short_len: int = 8, long_lens: tuple[int, int] = (2000, 1500),
                   seed: int = 1):
    """cells.py's cells and draw order. Per prompt length L: (target, {cell: (batch, row)})."""
    P = _drawer(seed, hi)
    out = {}
    for L in lens:
        tgt = P(L)
        cells = {
            CELL_NAMES[0]: ([tgt], 0),
            CELL_NAMES[1]: ([P(short_len) for _ in range(40)] + [tgt] + [P(short_len) for _ in range(23)], 40),
            CELL_NAMES[2]: ([P(long_lens[0]) for _ in range(3)] + [tgt] + [P(long_lens[1]) for _ in range(4)], 3),
            CELL_NAMES[3]: ([tgt[: L // 2] + P(50), tgt], 1),
            CELL_NAMES[4]: ([tgt, P(100)], 0),
        }
        out[L] = (tgt, cells)
    return out


def cells_max_len(lens: list[int], long_lens: tuple[int, int], new_tokens: int) -> int:
    """Longest sequence any cell request reaches (prompt + generated tokens)."""
    return max([L + new_tokens for L in lens] + [n + new_tokens for n in long_lens]
               + [L // 2 + 50 + new_tokens for L in lens] + [100 + new_tokens])


# ------------------------------------------------------------------ measurements
def timed(side, prompts, max_tokens: int, logprobs: int | None):
    t = time.perf_counter()
    outs = side.generate(prompts, max_tokens, logprobs)
    return time.perf_counter() - t, outs


def measure_decode(side, batches: list[int], ctx: int, new_tokens: int, hi: int, logprobs: int | None,
                   log=print) -> dict:
    """Time per output token at each batch size, bench.py's definition:
    (time of generate(max_tokens=new_tokens+1) - time of generate(max_tokens=1))
    / new_tokens, the two calls on different fresh prompts (no prefix hits).
    Before the timed pair, the same pair runs once untimed on other prompts
    (seed 100) so that no kernel compiles or autotunes inside the timing."""
    warm, work = decode_workload(batches, ctx, hi, seed=0)
    _, warm_work = decode_workload(batches, ctx, hi, seed=100)
    side.generate([warm], 4, None)  # bench.py's warm-up call
    rows = {}
    for bs in batches:
        wa, wb = warm_work[bs]
        side.generate(wa, 1, logprobs)
        side.generate(wb, new_tokens + 1, logprobs)
        a, b = work[bs]
        t1, _ = timed(side, a, 1, logprobs)
        t2, outs = timed(side, b, new_tokens + 1, logprobs)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [new_tokens + 1] * bs:
            raise RuntimeError(f"decode batch {bs}: expected {new_tokens + 1} tokens per request, got {got}")
        tpot = (t2 - t1) / new_tokens
        rows[str(bs)] = {"tpot_ms": tpot * 1e3, "tok_s": bs / tpot, "t_1_token_s": t1,
                         f"t_{new_tokens + 1}_tokens_s": t2}
        log(f"decode bs={bs:4d}  TPOT {tpot * 1e3:8.3f} ms  ({bs / tpot:9.0f} tok/s)")
    return {"batches": rows, "ctx": ctx, "new_tokens": new_tokens, "logprobs": logprobs,
            "definition": "(t(generate max_tokens=new_tokens+1) - t(generate max_tokens=1)) / new_tokens, "
                          "fresh prompts for each call, greedy, ignore_eos"}


def measure_prefill(side, lens: list[int], reps: int, hi: int, log=print) -> dict:
    """Prefill tokens/s: generate(max_tokens=1) of one prompt of n tokens,
    after one warm-up prompt of the same length; median of `reps`."""
    rows = {}
    for n, ps in prefill_workload(lens, reps, hi).items():
        side.generate([ps[0]], 1, None)
        ts = [timed(side, [p], 1, None)[0] for p in ps[1:]]
        med = statistics.median(ts)
        rows[str(n)] = {"seconds": med, "tok_s": n / med, "all_s": ts}
        log(f"prefill {n:6d} tokens: {med * 1e3:9.2f} ms  {n / med:10.0f} tok/s")
    return {"lens": rows, "reps": reps,
            "definition": "median over reps of n / t(generate one n-token prompt, max_tokens=1), after a warm-up"}


def picks(output) -> list:
    """Per generated token: (token id, sorted [(id, logprob)] of the returned
    top-k dict) — cells.py's comparator, compared with ==."""
    c = output.outputs[0]
    return [(int(t), sorted((int(k), float(v.logprob)) for k, v in d.items()))
            for t, d in zip(c.token_ids, c.logprobs)]


def _first_diff(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure_cells(side, lens: list[int], hi: int, *, new_tokens: int = 16, top: int = 5, short_len: int = 8,
                  long_lens: tuple[int, int] = (2000, 1500), log=print) -> dict:
    """cells.py: per prompt length, the reference is the target alone, cold
    (first time the engine sees it); then each cell runs the target inside a
    batch (the prefix cache keeps what earlier calls left: the first cell is
    the warm rerun) and passes iff its 16 chosen tokens and top-5 logprobs
    are == to the reference's."""
    rows = {}
    for L, (tgt, cells) in cells_workload(lens, hi, short_len=short_len, long_lens=long_lens).items():
        ref = picks(side.generate([tgt], new_tokens, top)[0])
        for name, (batch, row) in cells.items():
            out = side.generate(batch, new_tokens, top)[row]
            got = picks(out)
            diff = _first_diff(ref, got)
            rows[f"L={L}: {name}"] = {
                "L": L, "cell": name, "pass": got == ref, "first_diff": diff,
                "tokens_equal": [t for t, _ in got] == [t for t, _ in ref],
                "num_cached_tokens": getattr(out, "num_cached_tokens", None), "batch": len(batch), "row": row}
        log(f"cells L={L}: " + ", ".join(f"{n}: {'pass' if rows[f'L={L}: {n}']['pass'] else 'FAIL'}"
                                         for n in cells))
    passed = sum(r["pass"] for r in rows.values())
    log(f"cells passed {passed}/{len(rows)}")
    return {"cells": rows, "passed": passed, "total": len(rows), "new_tokens": new_tokens, "top_logprobs": top,
            "comparator": "== on [(token, sorted [(id, logprob)] of the top-5 dict)] over 16 greedy tokens"}


def measure_part(side, spec: dict, part: str, log=print) -> dict:
    """One part ("decode", "prefill" or "cells") of a worker spec, on either engine."""
    hi, perf, cells = spec["hi"], spec["perf"], spec["cells"]
    if part == "decode":
        return measure_decode(side, perf["batches"], perf["ctx"], perf["new_tokens"], hi, perf["logprobs"], log=log)
    if part == "prefill":
        return measure_prefill(side, perf["prefill_lens"], perf["prefill_reps"], hi, log=log)
    return measure_cells(side, cells["lens"], hi, short_len=cells["short_len"], long_lens=tuple(cells["long_lens"]),
                         log=log)

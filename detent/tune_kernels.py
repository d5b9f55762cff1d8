"""`KernelCost` (docs/tune.md, "Cost models"): a candidate tuple's cost as the
time of the kernel calls the profile recorded, without replaying the
workload or capturing the engine's graphs.

For each searched family, the profile's (call site, runtime inputs) are
grouped into buckets (every input rounded down to a power of 1.25, so a
decode step at 1,000 or 1,010 KV tokens is one bucket) and the `max_inputs` most
called buckets are kept. Each is run as one kernel call on synthetic inputs
of its shape — the candidate the tuple's dispatcher selects for it, with the
parameters it selects — timed (median of `reps`, after a warm-up call), and
weighted by its count. The cost is the sum, in milliseconds: the time the
searched families' kernels would take over the profiled steps. gemm,
attention and moe calls are timed; other families have no choice to make.
Under the "tpot" objective a call's count is its steps' decode rows
(detent/tune_engine.py), so a prefill-only step's calls weigh 0 and are not
timed, and the sum is divided by the profile's decode rows (`decode_rows`):
kernel milliseconds per output token, a TPOT estimate.

On CUDA a call is timed as the engine runs it, inside a CUDA graph: `GRAPH_CALLS`
calls captured once, the replay timed with CUDA events, so the device time
counts and the host's launch does not. A decode step's attention call takes a
few microseconds on the device, so timed one by one around a sync its launch
path is most of what is measured; lease 21's whole-W-A tune, timed that way,
saw the default's cost move from 1,811 to 1,427 within its search. A call that
does not capture is timed on the host clock instead, and counted in `host_timed`.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch

from detent.selection import CommitmentTuple, make_dispatcher
from detent.selection.context import AttentionMetadata
from detent.tune_engine import Loop, loops_unit

TIMED = ("gemm", "attention", "moe")
GRAPH_CALLS = 8  # calls per captured graph on CUDA: the graph's own launch spread over them
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _down(x: int, base: float = 1.25) -> int:
    return x if x <= 4 else max(4, int(base ** math.floor(math.log(x, base) + 1e-9)))


def bucket(runtime: tuple) -> tuple:
    """Runtime inputs rounded down to a power of 1.25: still inside the selector's domain, and the
    order between them (q <= k, sequences <= tokens) is kept because rounding down is monotone."""
    return tuple((k, _down(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in runtime)


def _attention_meta(rt: dict[str, int], block_size: int, device) -> tuple[AttentionMetadata, int]:
    """A batch with these runtime inputs: one sequence at (max q, max k), the rest sharing what is left."""
    n, t, mq, mk, tkv = rt["num_seqs"], rt["num_tokens"], rt["max_seqlen_q"], rt["max_seqlen_k"], rt["total_kv"]
    qs, ks = [mq], [mk]
    rest_q, rest_k = max(t - mq, n - 1), max(tkv - mk, n - 1)
    for i in range(n - 1):
        q = max(1, rest_q // (n - 1) + (i < rest_q % (n - 1)))
        qs.append(min(q, mq))
        ks.append(min(mk, max(qs[-1], rest_k // (n - 1))))
    qsl, slots, tables, nb = [0], [], [], 0
    max_blocks = -(-max(ks) // block_size)
    for q, k in zip(qs, ks):
        blocks = list(range(nb + 1, nb + 1 + -(-k // block_size)))  # block 0 stays unused, as the engine's
        nb += len(blocks)
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(k - q, k)]
        qsl.append(qsl[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(torch.tensor(qsl, **i32), torch.tensor(ks, **i32), torch.tensor(tables, **i32),
                             torch.tensor(slots, dtype=torch.int64, device=device), n, qsl[-1], max(qs), max(ks),
                             block_size, tuple(qsl), tuple(ks))
    return meta, nb + 1


def _call(family: str, site: dict, rt: dict, fn, kw: dict, device):
    """A closure making one call of `fn` on synthetic inputs of this shape."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = _DTYPES.get(site.get("dtype", "float32"), torch.float32)
    rand = lambda *s: (0.02 * torch.randn(*s, generator=g)).to(dt).to(device)  # noqa: E731
    m = rt["num_tokens"]
    if family == "gemm":
        x, w = rand(m, site["k"]), rand(site["n"], site["k"])
        return lambda: fn(x, w, None, **kw)
    if family == "attention":
        h, kvh, d = site["num_heads"], site["num_kv_heads"], site["head_dim"]
        meta, blocks = _attention_meta(rt, site["block_size"], device)
        q, k, v = rand(meta.num_tokens, h, d), rand(meta.num_tokens, kvh, d), rand(meta.num_tokens, kvh, d)
        cache = torch.zeros(2, blocks, site["block_size"], kvh, d, dtype=dt, device=device)
        return lambda: fn(q, k, v, cache, meta, d ** -0.5, **kw)
    e, hid, inter = site["num_experts"], site["hidden"], site["intermediate"]
    x, logits = rand(m, hid), torch.randn(m, e, generator=g).to(device)
    w13, w2 = rand(e, 2 * inter, hid), rand(e, hid, inter)
    return lambda: fn(x, logits, w13, w2, site["top_k"], True, **kw)


class KernelCost:
    def __init__(self, calls: dict, facts: dict[str, Any], workdir: str, *, families=TIMED, max_inputs: int = 64,
                 reps: int = 3, decode_rows: int | None = None, loops: list[tuple[Loop, dict, int]] | None = None):
        """decode_rows: the profile's ("tpot"): the cost is then per decode row; None: the sum.
        loops: per loop, (the loop, its calls, its decode rows) (`TupleInstaller.profile_loops`,
        "tpot" only): the cost is then the geometric mean of each loop's kernel time per decode
        row, one weight per load the loop stands for, as `EngineCost` weighs the loops, each
        loop's `max_inputs` most weighed buckets kept."""
        self.facts, self.workdir, self.reps = facts, workdir, max(1, reps)
        if decode_rows is not None and decode_rows < 1:
            raise ValueError(f"kernel cost per decode row: the profile has {decode_rows} decode rows")
        self.unit = ("ms of kernel time over the profiled calls" if decode_rows is None
                     else "ms of kernel time per decode row (a TPOT estimate)")
        self.device = torch.device("cuda" if facts.get("device") == "cuda" else "cpu")

        def kept(c: dict) -> list:
            weights: Counter = Counter()
            for (family, site, runtime), n in c.items():
                if family in families and family in TIMED and n > 0:
                    weights[(family, site, bucket(runtime))] += n
            return sorted(weights.items(), key=lambda kv: (-kv[1], repr(kv[0])))[:max_inputs]
        if loops is not None and len(loops) > 1:
            if decode_rows is None or any(rows < 1 for _, _, rows in loops):
                raise ValueError("kernel cost over closed loops: per decode row only, and every loop needs decode "
                                 f"rows (got {[rows for _, _, rows in loops]})")
            self.loops = [(kept(c), rows, loop.weight) for loop, c, rows in loops]
            self.unit += loops_unit([loop for loop, _, _ in loops])
        else:
            self.loops = [(kept(calls), decode_rows or 1, 1)]
        merged: Counter = Counter()
        for ins, _, _ in self.loops:
            merged.update(dict(ins))
        # every bucket kept, with its weight over the loops (each is timed once a measurement)
        self.inputs = sorted(merged.items(), key=lambda kv: (-kv[1], repr(kv[0])))
        self._n = 0
        self.times: dict[str, dict[tuple, float]] = {}  # tuple hash -> bucket -> seconds, its last measurement
        self.graph_timed = self.host_timed = 0  # calls timed each way (CUDA graphs, or the host clock)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _time(self, call) -> float:
        call()  # warm-up: compiles a Triton config the first time
        if self.device.type == "cuda":
            t = self._time_graph(call)
            if t is not None:
                self.graph_timed += 1
                return t
        self.host_timed += 1
        out = []
        for _ in range(self.reps):
            self._sync()
            t0 = time.perf_counter()
            call()
            self._sync()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def _time_graph(self, call) -> float | None:
        """Seconds per call: `GRAPH_CALLS` calls in one CUDA graph, replayed between two events
        (median of `reps`, after one untimed replay); None when the call does not capture."""
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                for _ in range(GRAPH_CALLS):
                    call()
        except Exception:  # noqa: BLE001  (any capture failure: the host clock times it instead)
            torch.cuda.synchronize(self.device)
            return None
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(self.reps):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / GRAPH_CALLS)
        del g
        return statistics.median(out)

    def buckets(self, a: CommitmentTuple, b: CommitmentTuple, top: int = 24) -> list[dict[str, Any]]:
        """The `top` most weighed buckets with each tuple's time in µs (from its last measurement;
        None where it did not reach the bucket) and each closed loop's weight per decode row: where
        two tuples' kernel costs part (the report's `kernel_buckets`, default against the pick)."""
        ta, tb = self.times.get(a.hash, {}), self.times.get(b.hash, {})
        loops = [(dict(ins), rows) for ins, rows, _ in self.loops]
        out = []
        for key, n in self.inputs[:top]:
            family, site, runtime = key
            out.append({"family": family, "site": dict(site), "runtime": dict(runtime), "weight": n,
                        "per_row": [weights.get(key, 0) / rows for weights, rows in loops],
                        "us": [None if key not in t else 1e6 * t[key] for t in (ta, tb)]})
        return out

    @torch.inference_mode()
    def measure(self, t: CommitmentTuple, fraction: float) -> float:
        """Candidates compile their kernels here by design (the warm-up call of `_time`): the
        engine's compile watch, installed by a warm start in this process, must not log them as
        serving's."""
        from detent.engine.compile_watch import paused
        with paused():
            return self._measure(t, fraction)

    def _measure(self, t: CommitmentTuple, fraction: float) -> float:
        self._n += 1
        path = os.path.join(self.workdir, f"kernels-{self._n}.json")
        t.save(path)
        d = make_dispatcher(self.facts, "pinned", path)  # the loader's checks, as the engine's
        times: dict[tuple, float] = {}
        costs = []
        for inputs, rows, weight in self.loops:
            total = 0.0
            for key, n in inputs[:max(1, math.ceil(fraction * len(inputs)))]:
                if key not in times:
                    family, site, runtime = key
                    fn, kw = d.resolve(family, site, dict(runtime))
                    times[key] = self._time(_call(family, dict(site), dict(runtime), fn, kw, self.device))
                total += n * times[key]
            costs.append((1e3 * total / rows, weight))
        self.times[t.hash] = times
        if len(costs) == 1:
            return costs[0][0]
        return math.exp(sum(w * math.log(max(c, 1e-12)) for c, w in costs) / sum(w for _, w in costs))

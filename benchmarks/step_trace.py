"""Where the side-by-side's decode time goes, step by step (issue 10, item 3).

`compare_vllm.py` times a decode batch as (t(129 tokens) - t(1 token)) / 128
over whole `generate` calls, which include the prompts' prefill steps, the
steps that mix the last prompts' chunks with the first requests' decodes,
and the tail. This script runs that measurement itself on Detent
(common_side.measure_decode: the same prompts, engine arguments, warm-up
and TPOT), through a side that keeps every step each call launched: its
shape (sequences, tokens, whether it is decode-only and so a CUDA-graph
replay), the host time of the launch, and two CUDA events around it. From
the events: each step's device time, and the device's idle time before it
(the host was late). Then it sums the time of each kind of step
in both calls, so the difference t(129) - t(1) splits into decode steps,
mixed steps and idle time, and the Python collector's pauses (a full
collection is a ~0.1 s idle gap: EngineConfig.freeze_gc). With `--profile`,
torch.profiler adds the kernels' device time over the 129-token call.

    python3 benchmarks/step_trace.py --modes pinned,stock --batches 8,64 --out $OUT/trace
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common_side as cs  # noqa: E402
from detent_side import DetentSide  # noqa: E402
from gpu_engine import build, set_mode  # noqa: E402


class _HostEvent:
    """torch.cuda.Event's two methods on the host clock (CPU runs, tests)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


class StepRecorder:
    """Wraps a ModelRunner's `launch`: one record per launched step."""

    def __init__(self, runner):
        self.runner, self.orig, self.steps = runner, runner.launch, []
        self.cuda = runner.device.type == "cuda"
        self.gc_pauses: list[tuple[int, float]] = []  # (generation, ms) of the collector's runs
        self._gc_t0 = None
        runner.launch = self._launch
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_pauses.append((info["generation"], (time.perf_counter() - self._gc_t0) * 1e3))

    def _event(self):
        return torch.cuda.Event(enable_timing=True) if self.cuda else _HostEvent()

    def _launch(self, plan, prev=None):
        e0, e1 = self._event(), self._event()
        t = time.perf_counter()
        e0.record()
        h = self.orig(plan, prev)
        e1.record()
        qlens = [s.num_tokens for s in plan.seqs]
        self.steps.append({"seqs": len(qlens), "tokens": sum(qlens), "decode_only": max(qlens) == 1,
                           "decode_rows": sum(q == 1 for q in qlens), "host_launch_ms": (time.perf_counter() - t) * 1e3,
                           "_ev": (e0, e1)})
        return h

    def take(self) -> tuple[list[dict], list[tuple[int, float]]]:
        """The steps and the collector's pauses since the last take, as recorded
        (CUDA events not read yet: cheap enough to call inside a timed call)."""
        steps, self.steps = self.steps, []
        pauses, self.gc_pauses = self.gc_pauses, []
        return steps, pauses

    def timings(self, taken: tuple[list[dict], list[tuple[int, float]]]) -> tuple[list[dict], list]:
        """Read the events of what `take` returned: each step's device time and
        the device's idle time before it."""
        if self.cuda:
            torch.cuda.synchronize()
        steps, pauses = taken
        prev_end = None
        for s in steps:
            e0, e1 = s.pop("_ev")
            s["device_ms"] = e0.elapsed_time(e1)
            s["idle_before_ms"] = max(0.0, prev_end.elapsed_time(e0)) if prev_end is not None else 0.0
            prev_end = e1
        return steps, pauses


class RecordingSide:
    """A side whose every `generate` call keeps the steps it launched, in call order."""

    def __init__(self, side, rec: StepRecorder):
        self.side, self.rec, self.calls = side, rec, []

    def generate(self, prompts, max_tokens, logprobs):
        out = self.side.generate(prompts, max_tokens, logprobs)
        self.calls.append(self.rec.take())
        return out


def kind_of(s: dict) -> str:
    if s["decode_only"]:
        return f"decode b={s['seqs']}"
    return "prefill" if s["decode_rows"] == 0 else "mixed"


def summarize(steps_and_pauses: tuple[list[dict], list[tuple[int, float]]]) -> dict:
    steps, pauses = steps_and_pauses
    kinds: dict[str, dict] = {}
    for s in steps:
        k = kinds.setdefault(kind_of(s), {"steps": 0, "device_ms": 0.0, "idle_ms": 0.0, "host_launch_ms": 0.0,
                                          "tokens": 0, "_dev": []})
        k["steps"] += 1
        k["device_ms"] += s["device_ms"]
        k["idle_ms"] += s["idle_before_ms"]
        k["host_launch_ms"] += s["host_launch_ms"]
        k["tokens"] += s["tokens"]
        k["_dev"].append(s["device_ms"])
    for k in kinds.values():
        k["median_device_ms"] = statistics.median(k.pop("_dev"))
    full = [ms for g, ms in pauses if g == 2]
    return {"steps": len(steps), "device_ms": sum(s["device_ms"] for s in steps),
            "idle_ms": sum(s["idle_before_ms"] for s in steps), "kinds": kinds,
            "gc": {"collections": len(pauses), "ms": sum(ms for _, ms in pauses), "full_collections": len(full),
                   "full_ms": sum(full), "frozen_objects": gc.get_freeze_count()}}


def trace(side, rec: StepRecorder, batches: list[int], ctx: int, new_tokens: int, hi: int, logprobs,
          log=print) -> dict:
    """common_side.measure_decode itself (the side-by-side's calls, prompts and
    TPOT), with the steps of each batch size's timed pair split by kind."""
    rs = RecordingSide(side, rec)
    rec.take()
    m = cs.measure_decode(rs, batches, ctx, new_tokens, hi, logprobs, log=log)
    out = {}
    for i, bs in enumerate(batches):  # calls: the warm-up, then per batch size 2 untimed and 2 timed
        s1, s2 = (rec.timings(rs.calls[1 + 4 * i + j]) for j in (2, 3))
        out[str(bs)] = {**m["batches"][str(bs)], "call_1": summarize(s1), f"call_{new_tokens + 1}": summarize(s2),
                        "steps_1": s1[0], f"steps_{new_tokens + 1}": s2[0]}
    return out


def profile_call(side, rec: StepRecorder, bs: int, batches: list[int], ctx: int, new_tokens: int, hi: int,
                 logprobs, path: str) -> list:
    """torch.profiler's kernel times over one more (new_tokens + 1)-token call
    at batch size `bs` (fresh prompts); the full table goes to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    _, more = cs.decode_workload(batches, ctx, hi, seed=200)
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        side.generate(more[bs][1], new_tokens + 1, logprobs)
        torch.cuda.synchronize()
    rec.take()
    ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: -e.self_device_time_total)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
    return [(e.key[:100], e.self_device_time_total / 1e3, e.count) for e in ev[:30]]


def report(tag: str, r: dict, new_tokens: int) -> str:
    lines = [(f"{tag}: t(1) {r['t_1_token_s']:.3f} s, t({new_tokens + 1}) {r[f't_{new_tokens + 1}_tokens_s']:.3f} s, "
              f"TPOT {r['tpot_ms']:.3f} ms")]
    for call in ("call_1", f"call_{new_tokens + 1}"):
        c = r[call]
        g = c["gc"]
        lines.append(f"  {call}: {c['steps']} steps, device {c['device_ms']:.1f} ms, idle {c['idle_ms']:.1f} ms; "
                     f"gc {g['collections']} runs {g['ms']:.1f} ms, {g['full_collections']} full {g['full_ms']:.1f} ms")
        for k, v in sorted(c["kinds"].items()):
            lines.append(f"    {k:14s} {v['steps']:4d} steps  device {v['device_ms']:8.1f} ms (median "
                         f"{v['median_device_ms']:.3f})  idle {v['idle_ms']:7.1f} ms  host launch "
                         f"{v['host_launch_ms']:7.1f} ms  tokens {v['tokens']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--modes", default="pinned,stock")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="torch.profiler kernel times of one 129-token call")
    ap.add_argument("--out", default="trace")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    need = a.ctx + a.new_tokens + 1
    llm, mc, info = build(a.model, max_model_len=-(-need // 64) * 64, max_num_seqs=max(batches),
                          enable_prefix_caching=True)
    side, rec = DetentSide(llm), StepRecorder(llm.llm_engine.runner)
    hi = cs.prompt_hi(mc.vocab_size)
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "info": info, "modes": {}}
    for mode in a.modes.split(","):
        res["modes"][mode] = {"setup": set_mode(llm, mode, graphs=True)}
        llm.reset_prefix_cache()
        for bs, r in trace(side, rec, batches, a.ctx, a.new_tokens, hi, 1).items():
            tag = f"{mode}_b{bs}"
            if a.profile:
                r["kernels_ms"] = profile_call(side, rec, int(bs), batches, a.ctx, a.new_tokens, hi, 1,
                                               os.path.join(a.out, f"{tag}_kernels.txt"))
            res["modes"][mode][bs] = r
            print(report(tag, r, a.new_tokens), flush=True)
            for name, ms, n in r.get("kernels_ms", [])[:12]:
                print(f"    {ms:9.2f} ms  x{n:6d}  {name}", flush=True)
    with open(os.path.join(a.out, "step_trace.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()

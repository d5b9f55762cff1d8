"""The torch profiler over engine steps: `detent-serve --profiler-config`, `POST /start_profile`
and `POST /stop_profile`, as `vllm serve` has them (docs/server.md).

A window records the host's ops and the device's kernels (through CUPTI; kernels replayed
from CUDA graphs included) for `max_iterations` engine steps after `delay_iterations`, then
writes one Chrome trace into `torch_profiler_dir` (`benchmarks/vllm_profile.py` sums a
trace's kernels by family, for vLLM's traces and Detent's alike). Each step's launch is a
host range `detent.step.KIND` (decode, mixed, prefill), so Detent's kernel time also splits
by step kind. The profiler runs where
the engine steps (the core process under `detent-serve`); at tp > 1 it sees rank 0's host
and the kernels CUPTI reports to that process.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

# vLLM 0.20's ProfilerConfig keys that mean something here, and those it has that are taken
# and have no effect (the front end is never profiled; memory and FLOP counts are not kept)
KEYS = ("profiler", "torch_profiler_dir", "delay_iterations", "max_iterations", "torch_profiler_with_stack",
        "torch_profiler_record_shapes", "torch_profiler_use_gzip")
IGNORED_KEYS = ("ignore_frontend", "torch_profiler_with_flops", "torch_profiler_with_memory",
                "torch_profiler_dump_cuda_time_total")


@dataclass(frozen=True)
class ProfilerConfig:
    dir: str
    delay_iterations: int = 0  # engine steps after /start_profile before recording
    max_iterations: int = 0  # steps recorded, then the trace is written; 0: until /stop_profile
    with_stack: bool = False
    record_shapes: bool = False
    use_gzip: bool = True

    @classmethod
    def from_json(cls, text: str) -> ProfilerConfig:
        """From `--profiler-config`'s JSON (vLLM's keys); ValueError names what is wrong."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--profiler-config is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("--profiler-config must be a JSON object")
        unknown = sorted(set(d) - set(KEYS) - set(IGNORED_KEYS))
        if unknown:
            raise ValueError(f"--profiler-config: unknown key(s) {unknown}; known: {list(KEYS + IGNORED_KEYS)}")
        if d.get("profiler", "torch") != "torch":
            raise ValueError(f"--profiler-config: profiler {d['profiler']!r} is not supported (only 'torch')")
        if not isinstance(d.get("torch_profiler_dir"), str) or not d["torch_profiler_dir"]:
            raise ValueError("--profiler-config needs torch_profiler_dir, the directory the traces go to")
        ints = {}
        for k in ("delay_iterations", "max_iterations"):
            v = d.get(k, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"--profiler-config: {k} must be an integer >= 0, got {v!r}")
            ints[k] = v
        flags = {}
        for k, name, default in (("torch_profiler_with_stack", "with_stack", False),
                                 ("torch_profiler_record_shapes", "record_shapes", False),
                                 ("torch_profiler_use_gzip", "use_gzip", True)):
            v = d.get(k, default)
            if not isinstance(v, bool):
                raise ValueError(f"--profiler-config: {k} must be true or false, got {v!r}")
            flags[name] = v
        return cls(dir=os.path.abspath(d["torch_profiler_dir"]), **ints, **flags)


class StepProfiler:
    """One profiling window at a time, advanced by the engine's steps (`on_step`)."""

    def __init__(self, cfg: ProfilerConfig, device_type: str):
        self.cfg = cfg
        self.device_type = device_type
        self._prof = None
        self._armed = False  # /start_profile seen, the delay not yet over
        self._seen = 0  # steps since /start_profile
        self._recorded = 0
        self.traces: list[str] = []

    @property
    def active(self) -> bool:
        return self._armed or self._prof is not None

    def start(self) -> bool:
        """Arm a window; False if one is armed or recording already."""
        if self.active:
            return False
        os.makedirs(self.cfg.dir, exist_ok=True)
        self._armed, self._seen, self._recorded = True, 0, 0
        if self.cfg.delay_iterations == 0:
            self._begin()
        return True

    def on_step(self) -> None:
        if not self.active:
            return
        self._seen += 1
        if self._prof is not None:
            self._recorded += 1
            if self.cfg.max_iterations and self._recorded >= self.cfg.max_iterations:
                self._end()
        elif self._seen >= self.cfg.delay_iterations:
            self._begin()

    def annotate(self, name: str):
        """While recording, a host range named `name` (the step's launch: the kernels it launches,
        CUDA-graph replays included, link to it by their correlation ids, so a trace's kernel
        time splits by step kind; benchmarks/vllm_profile.py `by_annotation`)."""
        if self._prof is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function
        return record_function(name)

    def stop(self) -> str | None:
        """End the window: the trace's path, or None if nothing was recorded yet."""
        if self._prof is None:
            self._armed = False
            return None
        return self._end()

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU]
        if self.device_type == "cuda" and torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        self._armed = False
        self._prof = profile(activities=acts, record_shapes=self.cfg.record_shapes, with_stack=self.cfg.with_stack)
        self._prof.start()

    def _end(self) -> str:
        prof, self._prof = self._prof, None
        prof.stop()
        name = f"detent-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{len(self.traces)}.pt.trace.json"
        path = os.path.join(self.cfg.dir, name + (".gz" if self.cfg.use_gzip else ""))
        prof.export_chrome_trace(path)
        self.traces.append(path)
        return path


def start_profile(engine: Any, cfg: ProfilerConfig) -> dict:
    """What `POST /start_profile` runs where the engine lives (the server's `call`)."""
    return engine.start_profile(cfg)


def stop_profile(engine: Any) -> dict:
    return engine.stop_profile()

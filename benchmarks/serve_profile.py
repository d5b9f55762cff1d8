"""Where a loaded `detent-serve`'s time goes (issue 16, item 1).

Runs the server in this process (the same `build_state` + app as
`detent-serve`) with recorders attached, drives it with
benchmarks/loadgen.py in a separate process, one load phase after another,
and writes per phase:
- every engine step: its shape (prefill tokens, decode rows, sequences),
  host time of the launch, device time and the device's idle time before it
  (CUDA events, benchmarks/step_trace.StepRecorder);
- the engine thread's wall and CPU time in `step()`, the part of it spent
  waiting for the device in `collect`, and the rest, which is time the thread
  was runnable but not running: waiting for the GIL (or the OS);
- detokenization and output-building time (OutputProcessor);
- the event loop's lag (a 1 ms ticker: how late it woke) and each thread's
  CPU time (psutil), so HTTP + SSE work on the loop is visible;
- the collector's pauses.

    python3 benchmarks/serve_profile.py --phases c1,c16,c64,r10,r20 --out $OUT/prof -- \
        --model /tmp/wl8b --load-format dummy --dtype bfloat16 --max-model-len 4096 --served-model-name m
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class EngineRecorder:
    """Wraps LLMEngine.step, runner.collect and the output processor's text update."""

    def __init__(self, engine):
        from step_trace import StepRecorder

        self.steps = StepRecorder(engine.runner)
        self.calls: list[tuple[float, float, float]] = []  # (wall, thread cpu, collect wall) per step()
        self.detok_s = 0.0
        self._collect = 0.0
        orig_step, orig_collect, orig_text = engine.step, engine.runner.collect, engine.outputs.update_text

        def step():
            w, c = time.perf_counter(), time.thread_time()
            self._collect = 0.0
            out = orig_step()
            self.calls.append((time.perf_counter() - w, time.thread_time() - c, self._collect))
            return out

        def collect(h):
            t = time.perf_counter()
            try:
                return orig_collect(h)
            finally:
                self._collect += time.perf_counter() - t

        def update_text(req):
            t = time.perf_counter()
            try:
                return orig_text(req)
            finally:
                self.detok_s += time.perf_counter() - t

        engine.step, engine.runner.collect, engine.outputs.update_text = step, collect, update_text

    def take(self) -> dict:
        taken = self.steps.take()
        steps, pauses = self.steps.timings(taken)
        calls, self.calls = self.calls, []
        detok, self.detok_s = self.detok_s, 0.0
        from step_trace import summarize
        wall = sum(c[0] for c in calls)
        cpu = sum(c[1] for c in calls)
        coll = sum(c[2] for c in calls)
        mixed = [s for s in steps if not s["decode_only"]]
        return {"summary": summarize((steps, pauses)),
                "engine_thread": {"steps": len(calls), "step_wall_s": wall, "step_cpu_s": cpu,
                                  "collect_wait_s": coll, "not_running_s": max(0.0, wall - cpu - coll),
                                  "detok_and_outputs_s": detok},
                "prefill_chunks": {"steps_with_prefill": len(mixed),
                                   "prefill_tokens_per_step": [s["tokens"] - s["decode_rows"] for s in mixed][:2000]},
                "steps": steps[:5000]}


class LoopLag:
    def __init__(self):
        self.lags: list[float] = []

    async def run(self):
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)

    def take(self) -> dict:
        xs, self.lags = sorted(self.lags), []
        if not xs:
            return {}
        return {"ticks": len(xs), "p50_ms": 1e3 * xs[len(xs) // 2], "p99_ms": 1e3 * xs[int(len(xs) * 0.99)],
                "max_ms": 1e3 * xs[-1], "mean_ms": 1e3 * statistics.fmean(xs)}


def thread_cpu(names: dict[int, str]) -> dict[str, float]:
    import psutil
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        k = names.get(t.id, "other")
        out[k] = out.get(k, 0.0) + t.user_time + t.system_time
    return out


PHASES = {"c": "--concurrency", "r": "--rate"}


def phase_args(ph: str, n_closed: int, n_rate: int) -> list[str]:
    """"c16" (closed loop, 16 clients), "r20" (Poisson, 20 req/s), "c1:32" (32 prompts)."""
    ph, _, n = ph.partition(":")
    kind, val = ph[0], ph[1:]
    n = n or (n_closed if kind == "c" else n_rate)
    return [PHASES[kind], val, "--num-prompts", str(n)]


async def main_async(a, server_argv: list[str]) -> None:
    import uvicorn

    from detent.server.app import build_app
    from detent.server.cli import build_state, parse_args

    # the recorders wrap the engine's methods, so it runs in this process here
    sa = parse_args(server_argv + ["--port", str(a.port), "--no-engine-process"])
    state = build_state(sa)
    ae = state.engine
    eng = getattr(ae, "engine", None)
    rec = EngineRecorder(eng)
    lag = LoopLag()
    cfg = uvicorn.Config(build_app(state), host="127.0.0.1", port=a.port, loop="none", lifespan="on",
                         log_level="warning")
    server = uvicorn.Server(cfg)
    sys.setswitchinterval(0.001)  # as detent-serve does
    srv = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.1)
    names = {threading.main_thread().native_id: "event_loop", ae._thread.native_id: "engine"}
    lag_task = asyncio.create_task(lag.run())
    url = f"http://127.0.0.1:{a.port}"
    client = [sys.executable, os.path.join(HERE, "loadgen.py"), "--url", url, "--model", a.model_name]
    results = []
    for i, ph in enumerate(["c4"] + a.phases.split(",")):  # c4: warm-up (compiles, graphs)
        rec.take(), lag.take()
        cpu0, t0 = thread_cpu(names), time.perf_counter()
        # each phase its own prompts (seed), so no phase hits the prefix cache of an earlier one
        proc = await asyncio.create_subprocess_exec(*client, *phase_args(ph, a.num_closed, a.num_rate),
                                                    "--seed", str(100 + i), *a.client_args.split(),
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        wall = time.perf_counter() - t0
        cpu1 = thread_cpu(names)
        r = {"phase": ph, "wall_s": wall, "client": json.loads(out.decode().strip().splitlines()[-1]),
             "thread_cpu_frac": {k: (cpu1.get(k, 0) - cpu0.get(k, 0)) / wall for k in cpu1},
             "loop_lag": lag.take(), **rec.take()}
        et = r["engine_thread"]
        print(f"{ph}: {json.dumps(r['client'])}\n    engine {json.dumps(et)}\n    cpu {r['thread_cpu_frac']}"
              f" lag {r['loop_lag']}\n    kinds {json.dumps(r['summary']['kinds'])}", flush=True)
        if ph != "c4":
            results.append(r)
    lag_task.cancel()
    server.should_exit = True
    await srv
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "serve_profile.json"), "w") as f:
        json.dump({"server_argv": server_argv, "phases": results}, f)


def main() -> None:
    argv = sys.argv[1:]
    server_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser("serve_profile")
    p.add_argument("--phases", default="c1,c16,c64,r10,r20")
    p.add_argument("--num-closed", type=int, default=128)
    p.add_argument("--num-rate", type=int, default=300)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model-name", default="m")
    p.add_argument("--client-args", default="")
    p.add_argument("--out", default="out/serve_profile")
    a = p.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(a, server_argv))


if __name__ == "__main__":
    main()

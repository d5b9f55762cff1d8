"""benchmarks/serve_load.py's bookkeeping and its report (serve_load_report.py); the runs themselves need a GPU and vLLM."""
import os
import sys
import tarfile
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import serve_load  # noqa: E402
import serve_load_report  # noqa: E402


def test_a_load_keeps_its_seed_in_any_subset():
    # lease 5 ran r20 and c64 alone and got seeds 1 and 2, against 6 and 3 in the full run
    assert serve_load.seed_for("c1") == 1 and serve_load.seed_for("r20") == 6 and serve_load.seed_for("c64") == 3
    assert len({serve_load.seed_for(n) for n in serve_load.LOADS}) == len(serve_load.LOADS)


def test_pack_keeps_results_and_logs_not_the_sharegpt_file(tmp_path):
    for n in ("vllm-c1.json", "summary-detent.json", "sharegpt_synthetic.json", "detent.log", "serve_load.png"):
        (tmp_path / n).write_text("{}")
    serve_load.pack(str(tmp_path), str(tmp_path / "out.tgz"))
    assert tarfile.open(tmp_path / "out.tgz").getnames() == ["detent.log", "summary-detent.json", "vllm-c1.json"]


def test_a_run_in_parts_keeps_every_parts_loads(tmp_path):
    # lease 5's split runs overwrote the first part's summary with the second's
    path = str(tmp_path / "summary-detent.json")
    serve_load.write_summary(path, {"server": "detent", "startup_s": 9.0, "loads": {"c1": {"x": 1}},
                                    "probe": {"sent": 3}})
    serve_load.write_summary(path, {"server": "detent", "startup_s": 8.0, "loads": {"r20": {"x": 2}}})
    import json
    with open(path) as f:
        s = json.load(f)
    assert s["loads"] == {"c1": {"x": 1}, "r20": {"x": 2}} and s["probe"] == {"sent": 3} and s["startup_s"] == 8.0


class _Page:
    """urlopen's reply: one /metrics page."""

    def __init__(self, body):
        self.body = body

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read(self):
        return self.body


def _serve_pages(monkeypatch, pages: list) -> None:
    """serve_load's /metrics reads get these pages, one per read, in order."""
    served = iter(pages)
    monkeypatch.setattr(serve_load.urllib.request, "urlopen", lambda url, timeout: _Page(next(served)))


def test_step_kinds_are_read_from_detents_metrics_and_differenced_per_load(monkeypatch):
    from prometheus_client import generate_latest

    from detent.server.metrics import Metrics
    m = Metrics("m", 512)
    pages = []
    for stats, preempted in (({"decode": (10, 0.05, 40, 0.01, 0.02, 0.005, 0.01, 0, 0, 0.0, 0.0, 40, 0.2, 0),
                               "mixed": (2, 0.06, 2048, 0.04, 0.02, 0.0, 0.0)}, 1),
                             ({"decode": (30, 0.17, 160, 0.03, 0.06, 0.015, 0.03, 0, 0, 0.0, 0.0, 160, 0.83, 5),
                   "mixed": (5, 0.15, 5200, 0.1, 0.05, 0.0, 0.0),
                               "prefill": (1, 0.03, 1024, 0.02, 0.01, 0.004, 0.005, 0, 1, 0.025, 0.002)}, 4)):
        m.engine_stats({"steps_by_kind": stats, "num_preemptions": preempted})
        pages.append(generate_latest(m.registry))

    _serve_pages(monkeypatch, pages)
    before, after = serve_load.step_kinds("http://x"), serve_load.step_kinds("http://x")
    d = serve_load.kinds_delta(before, after)
    assert d["decode"]["steps"] == 20 and d["decode"]["tokens_per_step"] == 6.0
    assert abs(d["decode"]["ms_per_step"] - 6.0) < 1e-9 and abs(d["decode"]["wait_ms_per_step"] - 1.0) < 1e-9
    assert d["mixed"]["steps"] == 3 and abs(d["mixed"]["ms_per_step"] - 30.0) < 1e-9
    assert abs(d["decode"]["launch_ms_per_step"] - 2.0) < 1e-9
    # 120 decode rows that waited 0.63 s of steps in all: 5.25 ms a token
    assert d["decode"]["decode_rows_per_step"] == 6.0 and abs(d["decode"]["row_weighted_ms"] - 5.25) < 1e-9
    assert d["decode"]["rows_left_out_per_step"] == 5 / 20  # five rows left out over the load's 20 steps
    assert (before["engine"], after["engine"]) == ({"preemptions": 1}, {"preemptions": 4})
    assert abs(d["decode"]["prepare_ms_per_step"] - 0.5) < 1e-9 and abs(d["decode"]["forward_ms_per_step"] - 1.0) < 1e-9
    assert d["prefill"] == {"steps": 1, "seconds": 0.03, "tokens": 1024, "wait_seconds": 0.02, "launch_seconds": 0.01,
                            "prepare_seconds": 0.004, "forward_seconds": 0.005, "whole_graph_steps": 0,
                            "piecewise_steps": 1, "device_seconds": 0.025, "device_idle_seconds": 0.002, "ms_per_step": 30.0, "tokens_per_step": 1024.0, "wait_ms_per_step": 20.0,
                            "launch_ms_per_step": 10.0, "prepare_ms_per_step": 4.0, "forward_ms_per_step": 5.0,
                            "device_ms_per_step": 25.0, "device_idle_ms_per_step": 2.0, "decode_rows": 0,
                            "decode_row_seconds": 0, "decode_rows_per_step": 0.0, "rows_left_out": 0,
                            "rows_left_out_per_step": 0.0}  # no row: no weighted time


def test_the_report_has_the_ratios_and_detents_steps_by_kind(tmp_path, capsys):
    import json
    load = {"output_throughput": 100.0, "median_tpot_ms": 6.0, "p99_tpot_ms": 7.0, "median_ttft_ms": 30.0,
            "p99_ttft_ms": 40.0}
    (tmp_path / "summary-vllm.json").write_text(json.dumps({"loads": {"s10": load}}))
    steps = {"decode": {"steps": 100, "ms_per_step": 6.4, "tokens_per_step": 17.4, "wait_ms_per_step": 3.0,
                        "launch_ms_per_step": 1.2}}
    (tmp_path / "summary-detent.json").write_text(json.dumps(
        {"loads": {"s10": {**load, "median_tpot_ms": 7.2, "steps": steps}}}))
    serve_load_report.report(type("A", (), {"dir": str(tmp_path)}))
    text = (tmp_path / "serve_load.md").read_text()
    assert "| s10 | TPOT p50 | 6.00 | 7.20 | 1.20 |" in text
    assert "| s10 | decode | 100 | 6.40 | 17.4 | 3.00 | 1.20 |  |  |  |" in text  # no split, graphs or device
    steps["mixed"] = {"steps": 4, "ms_per_step": 20.0, "tokens_per_step": 900.0, "prepare_ms_per_step": 0.9,
                      "forward_ms_per_step": 8.1, "whole_graph_steps": 0, "piecewise_steps": 4,
                      "device_seconds": 0.07, "device_ms_per_step": 17.5, "device_idle_ms_per_step": 1.25}
    (tmp_path / "summary-detent.json").write_text(json.dumps(
        {"loads": {"s10": {**load, "median_tpot_ms": 7.2, "steps": steps}}}))
    serve_load_report.report(type("A", (), {"dir": str(tmp_path)}))
    text = (tmp_path / "serve_load.md").read_text()
    assert "| s10 | mixed | 4 | 20.00 | 900.0 | 0.00 | 0.00 | 0.90 / 8.10 | 0 / 4 | 17.50 / 1.25 |" in text


def test_the_report_has_a_row_block_for_each_tagged_detent_run(tmp_path):
    import json
    load = {"output_throughput": 100.0, "median_tpot_ms": 6.0, "p99_tpot_ms": 7.0, "median_ttft_ms": 30.0,
            "p99_ttft_ms": 40.0}
    (tmp_path / "summary-vllm.json").write_text(json.dumps({"loads": {"r20": load, "s10": load}}))
    (tmp_path / "summary-detent.json").write_text(json.dumps({"loads": {"r20": {**load, "median_tpot_ms": 6.6}}}))
    steps = {"mixed": {"steps": 5, "ms_per_step": 15.0, "tokens_per_step": 455.0}}
    (tmp_path / "summary-detent-graphs.json").write_text(json.dumps(
        {"loads": {"r20": {**load, "median_tpot_ms": 6.3, "steps": steps}}}))
    serve_load_report.report(type("A", (), {"dir": str(tmp_path)}))
    text = (tmp_path / "serve_load.md").read_text()
    assert "| r20 | TPOT p50 | 6.00 | 6.60 | 1.10 |" in text
    assert "| r20 (graphs) | TPOT p50 | 6.00 | 6.30 | 1.05 |" in text
    assert "| r20 (graphs) | mixed | 5 | 15.00 | 455.0 | 0.00 | 0.00 |  |  |  |" in text
    assert "s10 (graphs)" not in text  # a tagged run shows only the loads it ran


def test_a_tagged_detent_run_is_set_against_vllms_run_of_the_same_tag(tmp_path):
    import json
    load = {"output_throughput": 100.0, "median_tpot_ms": 6.0, "p99_tpot_ms": 7.0, "median_ttft_ms": 30.0,
            "p99_ttft_ms": 40.0}
    (tmp_path / "summary-vllm.json").write_text(json.dumps({"loads": {"r20": load}}))
    (tmp_path / "summary-vllmrep.json").write_text(json.dumps({"loads": {"r20": {**load, "median_tpot_ms": 8.0}}}))
    (tmp_path / "summary-detent.json").write_text(json.dumps({"loads": {"r20": {**load, "median_tpot_ms": 6.6}}}))
    (tmp_path / "summary-detentrep.json").write_text(json.dumps({"loads": {"r20": {**load, "median_tpot_ms": 7.2}}}))
    (tmp_path / "summary-detent-arm.json").write_text(json.dumps({"loads": {"r20": {**load, "median_tpot_ms": 6.3}}}))
    serve_load_report.report(type("A", (), {"dir": str(tmp_path)}))
    text = (tmp_path / "serve_load.md").read_text()
    assert "| r20 | TPOT p50 | 6.00 | 6.60 | 1.10 |" in text
    assert "| r20 (rep) | TPOT p50 | 8.00 | 7.20 | 0.90 |" in text  # the repeat against vLLM's repeat
    assert "| r20 (arm) | TPOT p50 | 6.00 | 6.30 | 1.05 |" in text  # no vLLM run of its tag: the untagged one



FAKE_BENCH = '''
import json, os
print("a benchmark that talks on stdout at import")  # vLLM's logging does (lease 9's first run beside it)
FLAGS = ("--ignore-eos", "--save-result")
OPTS = ("--backend", "--base-url", "--model", "--tokenizer", "--dataset-name", "--random-input-len",
        "--random-output-len", "--percentile-metrics", "--metric-percentiles", "--seed", "--num-prompts",
        "--max-concurrency", "--result-dir", "--result-filename", "--temperature", "--top-p")
RUNS = []
def add_cli_args(p):
    for f in FLAGS:
        p.add_argument(f, action="store_true")
    for o in OPTS:
        p.add_argument(o)
def main(args):
    print(args)
    os.write(1, b"and below Python too\\n")
    RUNS.append(args.num_prompts)  # one process for every run: the count survives
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump({"completed": int(args.num_prompts), "runs_in_this_process": len(RUNS), "label": "x",
                   "top_p": float(args.top_p or 1)}, f)
'''


def test_the_bench_worker_runs_every_load_in_one_process_and_survives_a_bad_one(tmp_path):
    (tmp_path / "fakebench.py").write_text(FAKE_BENCH)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    w = serve_load.BenchWorker(env, str(tmp_path / "bench.log"), module="fakebench")
    try:
        r = serve_load.bench(8100, "/m", ["--max-concurrency", "4"], 7, "random", 1, str(tmp_path), "a", "", "",
                             worker=w)
        assert r["completed"] == 7 and r["runs_in_this_process"] == 1 and "label" not in r and r["wall_s"] >= 0
        try:
            w.run(["--no-such-flag"])
            raise AssertionError("a bad argument must raise")
        except RuntimeError as e:
            assert "SystemExit" in str(e)
        r = serve_load.bench(8100, "/m", [], 9, "random", 2, str(tmp_path), "b", "", "", worker=w,
                             sampling=["--temperature=0.6", "--top-p=0.9"])
        assert r["completed"] == 9 and r["runs_in_this_process"] == 2  # the same process, after the error
        assert r["top_p"] == 0.9
    finally:
        w.close()
    assert w.proc.returncode == 0


def test_a_dead_bench_worker_raises_so_bench_falls_back_to_the_cli(tmp_path):
    w = serve_load.BenchWorker({**os.environ, "PYTHONPATH": str(tmp_path)}, str(tmp_path / "bench.log"),
                               module="no_such_module")
    try:
        try:
            w.run(["--num-prompts", "1"])
            raise AssertionError("a dead worker must raise")
        except RuntimeError as e:
            assert "exited" in str(e)
    finally:
        w.close()
    assert "ModuleNotFoundError" in (tmp_path / "bench.log").read_text()


def test_the_step_loops_host_time_is_read_by_part_and_reported_per_step(tmp_path, monkeypatch):
    import json

    from prometheus_client import generate_latest

    from detent.server.metrics import Metrics
    m = Metrics("m", 512)
    pages = []
    for host, decode in (({"schedule": 0.01, "wait": 0.02}, (10, 0.1, 10)),
                         ({"schedule": 0.03, "wait": 0.05, "ipc_out": 0.004}, (30, 0.3, 30))):
        m.engine_stats({"steps_by_kind": {"decode": decode}, "host_seconds": host})
        pages.append(generate_latest(m.registry))

    _serve_pages(monkeypatch, pages)
    before, after = serve_load.step_kinds("http://x"), serve_load.step_kinds("http://x")
    assert abs(after["host"]["wait"] - 0.05) < 1e-12 and "host" not in serve_load.kinds_delta(before, after)
    h = serve_load.host_delta(before, after, serve_load.kinds_delta(before, after))  # 20 steps
    assert abs(h["schedule"] - 1.0) < 1e-9 and abs(h["wait"] - 1.5) < 1e-9 and abs(h["ipc_out"] - 0.2) < 1e-9
    load = {"output_throughput": 100.0, "median_tpot_ms": 6.0, "p99_tpot_ms": 7.0, "median_ttft_ms": 30.0,
            "p99_ttft_ms": 40.0}
    (tmp_path / "summary-vllm.json").write_text(json.dumps({"loads": {"r20": load}}))
    (tmp_path / "summary-detent.json").write_text(json.dumps({"loads": {"r20": {**load, "host_ms_per_step": h}}}))
    serve_load_report.report(type("A", (), {"dir": str(tmp_path)}))
    text = (tmp_path / "serve_load.md").read_text()
    assert "| load | host ms/step: inbox | schedule | launch | wait | update | outputs | ipc_in | ipc_out |" in text
    assert "| r20 | 0.00 | 1.00 | 0.00 | 1.50 | 0.00 | 0.00 | 0.00 | 0.20 |" in text


def test_arms_run_one_server_after_the_other_with_one_bench_worker(tmp_path, monkeypatch):
    import json
    started, stopped, benched, workers = [], [], [], []

    class Proc:
        def poll(self):
            return None

    class Worker:
        def __init__(self, env, log_path):
            self.closed = False
            workers.append(self)

        def close(self):
            self.closed = True

        def dead(self):
            return False

    monkeypatch.setattr(serve_load, "start_server", lambda kind, model, port, extra, log, vp, lf: started.append(
        (port, extra, os.path.basename(log), lf)) or Proc())
    monkeypatch.setattr(serve_load, "stop_server", lambda proc: stopped.append(proc))
    monkeypatch.setattr(serve_load, "BenchWorker", Worker)
    monkeypatch.setattr(serve_load, "_get", lambda url, timeout=5.0: 200)
    monkeypatch.setattr(serve_load, "_post", lambda url, body: {"choices": [{"text": "x"}]})
    monkeypatch.setattr(serve_load, "step_kinds", lambda url: {})
    monkeypatch.setattr(serve_load.time, "sleep", lambda s: None)
    monkeypatch.setattr(serve_load, "bench", lambda port, md, args, n, ds, seed, out, name, sg, vp, worker, sampling:
                        benched.append((port, name, worker, sampling)) or {"output_throughput": float(port)})
    monkeypatch.setattr(serve_load, "write_sharegpt", lambda path: path)
    monkeypatch.setattr(serve_load.signal, "signal", lambda *args: None)  # keep pytest's own SIGTERM handler
    a = serve_load.argparse.Namespace(out=str(tmp_path), server="detent", model_dir="/m", port=8100, loads="c1",
                                      server_args="", tag="", vllm_path="", startup_timeout=5, pack="",
                                      arm=["=", "-g=--mixed-graph-max-tokens 2048"], load_format="auto",
                                      profile_load=None, sampling="--temperature=0.6 --top-p=0.9")
    serve_load.run(a)
    assert started == [(8100, [], "detent.log", "auto"),
                       (8101, ["--mixed-graph-max-tokens", "2048"], "detent-g.log", "auto")]
    assert len(stopped) == 2 and len(workers) == 1 and workers[0].closed
    assert [(p, n) for p, n, _, _ in benched] == [(8100, "detent-warmup"), (8100, "detent-c1"),
                                                  (8101, "detent-warmup"), (8101, "detent-c1-g")]
    assert all(w is workers[0] for _, _, w, _ in benched)
    # --sampling goes with every load, the warm-up's too, and the summary says which
    assert all(sp == ["--temperature=0.6", "--top-p=0.9"] for _, _, _, sp in benched)
    s = json.loads((tmp_path / "summary-detent-g.json").read_text())
    assert s["server_args"] == "--mixed-graph-max-tokens 2048" and s["loads"]["c1"]["output_throughput"] == 8101.0
    assert s["load_format"] == "auto"  # the run says whose weights the servers ran on
    assert s["sampling"] == "--temperature=0.6 --top-p=0.9"


def test_a_load_generator_that_cannot_import_stops_the_run_before_the_first_load(tmp_path, monkeypatch):
    stopped, benched = [], []

    class Proc:
        def poll(self):
            return None

    monkeypatch.setattr(serve_load, "start_server", lambda *args: Proc())
    monkeypatch.setattr(serve_load, "stop_server", lambda proc: stopped.append(proc))
    monkeypatch.setattr(serve_load, "_get", lambda url, timeout=5.0: 503)  # still starting
    monkeypatch.setattr(serve_load, "bench", lambda *args, **kw: benched.append(args))
    monkeypatch.setattr(serve_load.time, "sleep", lambda s: None)
    monkeypatch.setattr(serve_load, "write_sharegpt", lambda path: path)
    monkeypatch.setattr(serve_load.signal, "signal", lambda *args: None)
    monkeypatch.setattr(serve_load, "vllm_env", lambda path: {**os.environ, "PYTHONPATH": str(tmp_path)})
    real = serve_load.BenchWorker
    monkeypatch.setattr(serve_load, "BenchWorker", lambda env, log: real(env, log, module="no_such_module"))
    a = serve_load.argparse.Namespace(out=str(tmp_path), server="detent", model_dir="/m", port=8100, loads="c1",
                                      server_args="", tag="", vllm_path="/nowhere", startup_timeout=30, pack="",
                                      arm=[], load_format="dummy", profile_load=None, sampling="")
    t0 = time.time()
    with pytest.raises(SystemExit, match="load generator exited before the first load"):
        serve_load.run(a)
    assert time.time() - t0 < 30 and len(stopped) == 1 and benched == []
    assert "ModuleNotFoundError" in (tmp_path / "bench.log").read_text()


def test_vllm_profile_sums_a_traces_kernels_by_family(tmp_path):
    import gzip
    import json

    import vllm_profile
    ev = [{"ph": "X", "cat": "kernel", "name": "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "ts": 0, "dur": 2000},
          {"ph": "X", "cat": "kernel", "name": "void cutlass::device_kernel<flash::FlashAttnFwdSm90<>>", "ts": 2000,
           "dur": 500},
          {"ph": "X", "cat": "kernel", "name": "void vllm::reshape_and_cache_flash_kernel<>", "ts": 2500, "dur": 100},
          {"ph": "X", "cat": "kernel", "name": "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "ts": 2600,
           "dur": 300},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000}]  # host ops are not kernels
    (tmp_path / "w").mkdir()
    with gzip.open(tmp_path / "w" / "rank0.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = vllm_profile.summarize(str(tmp_path))
    assert s["families_ms"] == {"gemm": 2.0, "attention": 0.5, "norm": 0.3, "kv_store": 0.1}
    assert s["window_ms"] == 2.9 and s["kernel_ms"] == 2.9 and s["top_kernels"][0][1:] == [2.0, 1]
    assert "by_step" not in s  # vLLM's trace: no step ranges
    flags = vllm_profile.server_flags(str(tmp_path / "p"))
    assert flags[0] == "--profiler-config" and json.loads(flags[1])["profiler"] == "torch"
    with pytest.raises(SystemExit, match="no trace"):
        vllm_profile.summarize(str(tmp_path / "empty"))


def test_detent_step_ranges_split_the_kernel_time_by_step_kind(tmp_path):
    # each step's launch is a host range (engine/profiler.py); a kernel belongs to the range
    # holding the runtime call with its correlation id (a CUDA-graph launch too)
    import json

    import vllm_profile
    ann = lambda name, ts, dur: {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    call = lambda c, ts: {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 1,  # noqa: E731
                          "args": {"correlation": c}}
    kern = lambda c, name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                     "args": {"correlation": c}}
    ev = [ann("detent.step.mixed", 0, 100), call(1, 10), call(2, 20), ann("detent.step.decode", 200, 50),
          call(3, 210), call(4, 400),
          kern(1, "_tma_matmul_kernel", 300, 4000), kern(2, "_paged_attn_kernel", 4300, 2000),
          kern(3, "_tma_matmul_kernel", 6300, 1000), kern(4, "_rms_norm_kernel", 7300, 100),
          kern(9, "_rope_kernel", 7400, 50)]  # no launch call in the trace
    (tmp_path / "w").mkdir()
    with open(tmp_path / "w" / "detent-1.pt.trace.json", "w") as f:
        json.dump({"traceEvents": ev}, f)
    s = vllm_profile.summarize(str(tmp_path))
    assert s["by_step"] == {
        "detent.step.mixed": {"ranges": 1, "kernel_ms": 6.0, "families_ms": {"gemm": 4.0, "attention": 2.0}},
        "detent.step.decode": {"ranges": 1, "kernel_ms": 1.0, "families_ms": {"gemm": 1.0}},
        "unattributed": {"ranges": 0, "kernel_ms": pytest.approx(0.15), "families_ms": {"norm": 0.1, "rope": 0.05}}}


def test_the_profiled_load_runs_last_on_prompts_no_load_sent(tmp_path, monkeypatch):
    # the profiled rerun comes after every load, with --profile, under its own name, and with a
    # seed no load (nor the warm-up) uses: the same prompts again would be the prefix cache's
    benched = []

    class Proc:
        def poll(self):
            return None

    class Worker:
        def __init__(self, env, log):
            pass

        def close(self):
            pass

        def dead(self):
            return False

    monkeypatch.setattr(serve_load, "start_server", lambda *args: Proc())
    monkeypatch.setattr(serve_load, "stop_server", lambda proc: None)
    monkeypatch.setattr(serve_load, "BenchWorker", Worker)
    monkeypatch.setattr(serve_load, "_get", lambda url, timeout=5.0: 200)
    monkeypatch.setattr(serve_load, "_post", lambda url, body: {"choices": [{"text": "x"}]})
    monkeypatch.setattr(serve_load, "step_kinds", lambda url: {})
    monkeypatch.setattr(serve_load.time, "sleep", lambda s: None)
    monkeypatch.setattr(serve_load, "bench", lambda port, md, args, n, ds, seed, out, name, sg, vp, worker, sampling:
                        benched.append((name, seed, "--profile" in args)) or {"output_throughput": 1.0})
    monkeypatch.setattr(serve_load, "write_sharegpt", lambda path: path)
    monkeypatch.setattr(serve_load.signal, "signal", lambda *args: None)
    a = serve_load.argparse.Namespace(out=str(tmp_path), server="detent", model_dir="/m", port=8100, loads="c1,c16",
                                      server_args="", tag="", vllm_path="", startup_timeout=5, pack="", arm=[],
                                      load_format="dummy", profile_load="c1", sampling="")
    serve_load.run(a)  # no trace is written here: the summary step says so and the loads stand
    names = [n for n, _, _ in benched]
    assert names == ["detent-warmup", "detent-c1", "detent-c16", "detent-c1-profiled"]
    assert [p for _, _, p in benched] == [False, False, False, True]
    seeds = [s for _, s, _ in benched]
    assert seeds[3] not in seeds[:3] and seeds[3] not in {serve_load.seed_for(n) for n in serve_load.LOADS}
    import json
    s = json.loads((tmp_path / "summary-detent.json").read_text())
    assert set(s["loads"]) == {"c1", "c16", "c1-profiled"}


def test_the_servers_per_request_means_are_differenced_per_load(monkeypatch):
    # what the server saw of one load's requests, from either server's /metrics: Detent's page,
    # and the same page under vLLM's prefix
    from prometheus_client import generate_latest

    from detent.server.metrics import Metrics
    m = Metrics("m", 512)
    m.h["request_time_per_output_token_seconds"].observe(0.010)
    m.h["e2e_request_latency_seconds"].observe(2.0)
    first = generate_latest(m.registry)
    for tpot, e2e in ((0.020, 3.0), (0.030, 4.0)):
        m.h["request_time_per_output_token_seconds"].observe(tpot)
        m.h["e2e_request_latency_seconds"].observe(e2e)
    second = generate_latest(m.registry)
    for pages in ([first, second], [p.replace(b"detent:", b"vllm:") for p in (first, second)]):
        _serve_pages(monkeypatch, pages)
        before, after = serve_load.request_latency("http://x"), serve_load.request_latency("http://x")
        means = serve_load.latency_means(before, after)
        assert abs(means["request_time_per_output_token"] - 25.0) < 1e-9
        assert abs(means["e2e_request_latency"] - 3500.0) < 1e-9
        assert "time_to_first_token" not in means  # no request of the load observed it


def test_the_report_sets_the_clients_means_beside_the_servers(tmp_path):
    import json
    load = {"output_throughput": 100.0, "median_tpot_ms": 6.0, "p99_tpot_ms": 7.0, "median_ttft_ms": 30.0,
            "p99_ttft_ms": 40.0, "mean_ttft_ms": 31.0, "mean_tpot_ms": 20.5, "mean_e2el_ms": 2700.0}
    server = {"time_to_first_token": 30.0, "request_time_per_output_token": 14.7, "e2e_request_latency": 1950.0}
    (tmp_path / "summary-vllm.json").write_text(json.dumps({"loads": {"r20": load}}))
    # the steps' side: 30 decode rows of 9 ms steps and 30 of 26 ms steps wait 17.5 ms a token
    kind = {"steps": 1, "ms_per_step": 1.0, "tokens_per_step": 1.0}
    steps = {"decode": {**kind, "decode_rows": 30, "decode_row_seconds": 0.27},
             "mixed": {**kind, "decode_rows": 30, "decode_row_seconds": 0.78}}
    (tmp_path / "summary-detent.json").write_text(json.dumps(
        {"loads": {"r20": {**load, "server_mean_ms": server, "steps": steps, "preemptions": 3}}}))
    serve_load_report.report(type("A", (), {"dir": str(tmp_path)}))
    text = (tmp_path / "serve_load.md").read_text()
    assert "| r20 | detent | 31.00 / 30.00 | 20.50 / 14.70 | 2700.00 / 1950.00 | 17.50 | 3 |" in text
    assert "| r20 | vllm |" not in text  # a run without the server's means has no row

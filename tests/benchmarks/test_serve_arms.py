"""benchmarks/serve_arms.py end to end on CPU, in miniature: the tiny random
Llama, two workloads of two requests, every arm served by a real
`detent-serve` and driven over HTTP by benchmarks/workload_client.py, a
tuple tuned per workload by `detent tune` and served on every workload (the
drift matrix), and the report's tables and figures. Each load sends its own
prompts (none hits what an earlier one left in the prefix cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.mark.slow
def test_arms_in_miniature(tmp_path):
    from detent.models.tiny import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    out = tmp_path / "arms"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(BENCH, "serve_arms.py"), "run", "--model", model, "--out", str(out),
           "--workloads", "W-A,W-C", "--num-requests", "2", "--max-len", "40", "--device", "cpu",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32", "--port", "8197",
           "--tune-args", "--families gemm --interactions 0 --refine 0"]
    arms_first = ["stock,conservative,pinned-default,tuned-W-A"]
    # three calls, results merge; the third runs the default again, stored as pinned-default@2
    for arms in (arms_first, ["tuned-W-C"], ["pinned-default", "--tag", "@2"]):
        p = subprocess.run(cmd + ["--arms", *arms], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert (out / "tuple-W-C.json").exists() == (arms != arms_first)  # tuned-W tunes W's tuple alone
    res = json.loads((out / "arms.json").read_text())
    for w in ("W-A", "W-C"):  # the tunes time kernel calls (the engine cost does not fit 10 minutes at 8B)
        assert json.loads((out / f"tuple-{w}.report.json").read_text())["cost_model"] == "kernels"
    loads = ["A1", "A2", "A3", "A4", "C1", "C2"]
    assert set(res["arms"]) == {"stock", "conservative", "pinned-default", "tuned-W-A", "tuned-W-C", "pinned-default@2"}
    for arm, by_load in res["arms"].items():
        assert list(by_load) == loads, arm
        assert all(r["errors"] == 0 and r["requests"] == 2 and r["tpot_p50_ms"] > 0 for r in by_load.values()), arm
    from detent.workloads import load_seed, make
    want = {ld: sum(r.max_tokens for r in make(f"W-{ld[0]}", num_requests=2, max_len=40,
                                                seed=load_seed(0, ld)).requests) for ld in loads}
    for by_load in res["arms"].values():  # the client counted every streamed token (ignore_eos: exact lengths)
        assert all(round(r["output_tok_s"] * r["wall_s"]) == want[ld] for ld, r in by_load.items())
        # each load sent its own prompts (none the lambda_max run or an earlier load cached), every arm the same
        assert [r["prompt_seed"] for r in by_load.values()] == [load_seed(0, ld) for ld in loads]
        assert all(len(r["per_request"]["ttft_ms"]) == 2 and None not in r["per_request"]["tpot_ms"]
                   for r in by_load.values())
    assert res["lambda_max"]["W-A"] > 0 and res["arms"]["stock"]["A4"]["rate"] == res["lambda_max"]["W-A"]
    assert "W-C" not in res["lambda_max"]  # closed loops only: no maximum-throughput run for W-C
    assert res["arms"]["stock"]["C2"]["concurrency"] == 8
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["geomean_ratio_to_stock"]) == {"conservative", "pinned-default", "pinned-tuned"}
    assert all(v > 0 for v in rep["geomean_ratio_to_stock"]["pinned-tuned"].values())
    tvd = rep["tuned_vs_default"]  # per workload tuned / default p50 TPOT; per load the paired difference
    assert set(tvd["workloads"]) == {"W-A", "W-C"} and all(v > 0 for v in tvd["workloads"].values())
    assert set(tvd["loads"]) == set(loads) and all(p["n"] == 2 and p["lo"] <= p["hi"] for p in tvd["loads"].values())
    assert set(tvd["default_repeat"]) == {"W-A", "W-C"}  # the default's second run over its first
    drift = rep["drift"]
    assert [drift["W-A"][ld] for ld in loads[:4]] == [1.0] * 4 and [drift["W-C"][ld] for ld in loads[4:]] == [1.0] * 2
    assert all(v > 0 for row in drift.values() for v in row.values()) and len(drift["W-A"]) == 6
    md = (out / "arms.md").read_text()
    assert "| A1 | pinned-tuned |" in md and "Tuple drift" in md
    assert (out / "fig7.png").stat().st_size > 1000 and (out / "fig8.png").stat().st_size > 1000
    for w in ("W-A", "W-C"):
        assert json.loads((out / f"tuple-{w}.report.json").read_text())["workload"] == w
    early = subprocess.run(cmd + ["--arms", "conservative", "--loads", "A1", "--out", str(tmp_path / "fresh")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert early.returncode != 0 and "run --arms stock on them first" in early.stderr
    # an arm served without a stock run takes an earlier folder's lambda_max (lease 30), and says so
    borrowed, lacking = tmp_path / "borrowed", tmp_path / "lacking"  # several folders: the first that has it
    lacking.mkdir()
    (lacking / "arms.json").write_text(json.dumps({"workload_args": res["workload_args"], "lambda_max": {}}))
    b = subprocess.run(cmd + ["--arms", "pinned-default", "--loads", "A1", "--out", str(borrowed),
                              "--lambda-max-from", str(lacking), "--lambda-max-from", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    got = json.loads((borrowed / "arms.json").read_text())
    assert got["lambda_max"] == {"W-A": res["lambda_max"]["W-A"]}
    assert got["lambda_max_from"] == {"W-A": str(out / "arms.json")}
    assert list(got["arms"]["pinned-default"]) == ["A1"]
    assert got["arms"]["pinned-default"]["A1"]["rate"] == res["arms"]["stock"]["A1"]["rate"]
    # arms_gpu.sh asks for the rate its tunes place the loads at: the first folder that has it
    lm = subprocess.run([sys.executable, os.path.join(BENCH, "serve_arms.py"), "lambda-max", "W-A",
                         str(tmp_path / "none"), str(lacking), str(out)], capture_output=True, text=True, timeout=60)
    assert lm.returncode == 0 and float(lm.stdout) == res["lambda_max"]["W-A"]
    n = cmd.index("--num-requests")
    unlike = subprocess.run(cmd[:n + 1] + ["3"] + cmd[n + 2:] + ["--arms", "pinned-default", "--out",
                            str(tmp_path / "unlike"), "--lambda-max-from", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert unlike.returncode != 0 and "--lambda-max-from" in unlike.stderr and "other workloads" in unlike.stderr
    other = subprocess.run(cmd[:cmd.index("--workloads")] + ["--workloads", "W-B"] + cmd[cmd.index("--workloads") + 2:],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and "holds other workloads" in other.stderr  # results never mix
    old = tmp_path / "old"  # a folder from before each load had its own prompts is not merged into
    old.mkdir()
    (old / "arms.json").write_text(json.dumps({k: v for k, v in res.items() if k != "load_prompts"}))
    stale = subprocess.run(cmd + ["--arms", "pinned-default", "--out", str(old)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert stale.returncode != 0 and "re-sent the workload's own prompts" in stale.stderr


def test_a_tune_places_the_poisson_loads_at_stocks_lambda_max(tmp_path, monkeypatch):
    """`run` tunes after it has stock's lambda_max (its own folder's, or borrowed), and gives it to
    `detent tune --max-throughput`; a workload without one is measured by the tune itself."""
    import argparse
    sys.path.insert(0, BENCH)
    import serve_arms
    ran = []
    monkeypatch.setattr(serve_arms.subprocess, "run", lambda cmd, check: ran.append(cmd))
    a = argparse.Namespace(out=str(tmp_path), model="m", tune_args="", num_requests=64, max_len=None, device="cuda",
                           dtype="bfloat16", max_model_len=None, max_num_batched_tokens=None, max_num_seqs=None,
                           tp=None, load_format=None)
    serve_arms.tune_all(a, ["W-B", "W-A"], {"W-B": 3.005})
    assert ran[0][ran[0].index("--max-throughput") + 1] == "3.005" and "--max-throughput" not in ran[1]

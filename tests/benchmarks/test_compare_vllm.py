"""benchmarks/compare_vllm.py end to end on CPU: Detent's side with a tiny
random Llama (--tiny) through every part (decode, prefill, cells) in stock
and pinned, the results file's keys and merge, the report's tables and PNG,
and that the prompts are drawn exactly as vLLM's peer scripts draw them
(the vLLM peer bundle's bench.py and cells.py, transcribed below as the oracle).
"""
from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import common_side as cs  # noqa: E402
import compare_vllm  # noqa: E402

TINY = ["--tiny", "--decode-ctx", "16", "--decode-tokens", "4", "--prefill-lens", "32", "--prefill-reps", "1",
        "--cell-lens", "24,40", "--cell-long-lens", "40,32", "--max-num-batched-tokens", "64",
        "--cells-max-num-batched-tokens", "32"]


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tiny models: one thread is fastest on a shared machine
    p = subprocess.run([sys.executable, os.path.join(BENCH, "compare_vllm.py"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cmp") / "r.json")
    _run("--engine", "detent", "--modes", "stock,pinned", "--batches", "1,4", *TINY, "--out", out)
    with open(out) as f:
        return out, json.load(f)


@pytest.mark.slow
def test_every_part_and_mode_is_recorded(results):
    _, data = results
    runs = data["runs"]
    assert set(runs) == {f"detent/{m}/tiny/{p}" for m in ("stock", "pinned") for p in ("decode", "prefill", "cells")}
    for key, e in runs.items():
        assert key == compare_vllm.run_key(e["engine"], e["mode"], e["model"], e["part"])
        assert e["engine_args"]["enable_prefix_caching"] is True
    for m in ("stock", "pinned"):
        dec = runs[f"detent/{m}/tiny/decode"]
        assert sorted(dec["batches"]) == ["1", "4"] and dec["new_tokens"] == 4 and dec["logprobs"] == 1
        assert dec["engine_args"]["max_num_batched_tokens"] == 64
        assert all(r["tpot_ms"] > 0 and r["tok_s"] > 0 for r in dec["batches"].values())
        pre = runs[f"detent/{m}/tiny/prefill"]
        assert list(pre["lens"]) == ["32"] and pre["lens"]["32"]["tok_s"] > 0
        cells = runs[f"detent/{m}/tiny/cells"]
        assert cells["engine_args"]["max_num_batched_tokens"] == 32
        assert list(cells["cells"]) == [f"L={L}: {n}" for L in (24, 40) for n in cs.CELL_NAMES]
        assert cells["total"] == 10 and cells["passed"] == sum(c["pass"] for c in cells["cells"].values())
        for L in (24, 40):  # the warm rerun really was served from the prefix cache
            assert cells["cells"][f"L={L}: rerun (warm prefix cache)"]["num_cached_tokens"] >= 16


@pytest.mark.slow
def test_cells_separate_pinned_from_stock(results):
    _, data = results
    pinned = data["runs"]["detent/pinned/tiny/cells"]
    stock = data["runs"]["detent/stock/tiny/cells"]
    assert pinned["passed"] == 10, {k: v for k, v in pinned["cells"].items() if not v["pass"]}
    assert stock["passed"] < 10  # the cells can fail: stock's kernels change with the batch
    failed = [c for c in stock["cells"].values() if not c["pass"]]
    assert all(c["first_diff"] is not None for c in failed)


@pytest.mark.slow
def test_out_merges_by_key_and_report_writes_png(results, tmp_path):
    _, data = results
    out = str(tmp_path / "r.json")
    with open(out, "w") as f:
        json.dump(data, f)
    # a second run of one part replaces only its own key
    _run("--engine", "detent", "--modes", "pinned", "--parts", "decode", "--batches", "2", *TINY, "--out", out)
    with open(out) as f:
        merged = json.load(f)["runs"]
    assert set(merged) == set(data["runs"])
    assert list(merged["detent/pinned/tiny/decode"]["batches"]) == ["2"]
    for k in set(merged) - {"detent/pinned/tiny/decode"}:
        assert merged[k] == data["runs"][k]
    # a vLLM stock entry (stock Detent's numbers, times 0.5) merged from another file gives the ratio column
    peer = {"runs": {}}
    for part in ("decode", "prefill", "cells"):
        e = copy.deepcopy(data["runs"][f"detent/stock/tiny/{part}"])
        e["engine"] = "vllm"
        for r in e.get("batches", {}).values():
            r["tpot_ms"] *= 0.5
        peer["runs"][f"vllm/stock/tiny/{part}"] = e
    peer_path = str(tmp_path / "peer.json")
    with open(peer_path, "w") as f:
        json.dump(peer, f)
    png = str(tmp_path / "chart.png")
    md = _run("--merge", peer_path, "--report", "--out", out, "--png", png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(out) as f:
        assert "vllm/stock/tiny/cells" in json.load(f)["runs"]
    assert "| batch | vLLM stock | Detent stock | Detent pinned |" in md
    assert "(2.00×)" in md  # Detent stock / (its own time halved)
    assert "| **passed** | " in md and "| 10/10 |" in md.split("**passed**")[1].split("\n")[0]


def test_prompts_are_drawn_as_the_vllm_peer_scripts_draw_them():
    # bench.py: rnd = Random(0); P(64) warm-up; per batch size: prompts of the 1-token call, then fresh ones
    rnd = random.Random(0)
    P = lambda n: [rnd.randrange(10, 128000) for _ in range(n)]  # noqa: E731
    warm = P(64)
    want = {bs: ([P(50) for _ in range(bs)], [P(50) for _ in range(bs)]) for bs in (1, 8)}
    assert cs.decode_workload([1, 8], 50, 128000) == (warm, want)
    # cells.py: rnd = Random(1); per L the target, then the cells' neighbours in dict order
    rnd = random.Random(1)
    tgt = P(30)
    a, b = [P(8) for _ in range(40)], [P(8) for _ in range(23)]
    c, d = [P(2000) for _ in range(3)], [P(1500) for _ in range(4)]
    half = tgt[:15] + P(50)
    one = P(100)
    got_tgt, cells = cs.cells_workload([30], 128000)[30]
    assert got_tgt == tgt
    assert list(cells.values()) == [([tgt], 0), (a + [tgt] + b, 40), (c + [tgt] + d, 3), ([half, tgt], 1),
                                    ([tgt, one], 0)]


def test_vllm_side_imports_neither_detent_nor_vllm_nor_torch():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import vllm_side, compare_vllm; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('detent', 'vllm', 'torch')]; print(bad)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


@pytest.mark.parametrize("args, msg", [
    (["--engine", "vllm", "--tiny"], "--tiny runs Detent on CPU"),
    (["--engine", "detent", "--parts", "decode,speed"], "--parts: unknown ['speed']"),
    (["--engine", "vllm", "--modes", "pinned"], "'pinned' is not a vllm mode"),
    (["--engine", "detent", "--model", "llama-9"], "unknown preset 'llama-9'"),
    (["--engine", "detent", "--tiny", "--max-model-len", "64"], "the workload needs >= "),
    (["--engine", "detent", "--decode-logprobs", "all"], "--decode-logprobs: a number or 'none'"),
])
def test_bad_arguments_name_the_flag(args, msg, tmp_path):
    with pytest.raises(SystemExit) as e:
        compare_vllm.build_specs(compare_vllm.parse_args(args + ["--out", str(tmp_path / "x.json")]))
    assert msg in str(e.value)



def test_block_size_reaches_both_engines_and_defaults_to_theirs(tmp_path):
    out = ["--out", str(tmp_path / "x.json")]
    for engine in ("detent", "vllm"):
        specs = compare_vllm.build_specs(compare_vllm.parse_args(["--engine", engine, "--block-size", "128"] + out))
        assert specs and all(s["engine_args"]["block_size"] == 128 for s in specs)
        specs = compare_vllm.build_specs(compare_vllm.parse_args(["--engine", engine] + out))
        assert all("block_size" not in s["engine_args"] for s in specs)

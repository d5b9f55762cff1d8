"""benchmarks/arms_report.py's comparison of the tuned tuple with the default
(issue 20: tuned <= default TPOT on every workload): the ratio per workload,
the paired per-request difference per load and the default's run-to-run
drift, against numbers worked by hand."""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import arms_report  # noqa: E402


def _load(workload: str, p50: float, tpots: list[float] | None = None) -> dict:
    r = {"workload": workload, "errors": 0, **{m: p50 for m in arms_report.METRICS}}
    if tpots is not None:
        r["per_request"] = {"tpot_ms": tpots, "ttft_ms": [1.0] * len(tpots)}
    return r


def test_paired_difference_is_the_median_with_an_interval_that_holds_it():
    default = [5.0 + 0.01 * i for i in range(40)]
    tuned = [x - 0.02 for x in default]  # every request 0.02 ms faster
    p = arms_report.paired(tuned, default)
    assert math.isclose(p["median"], -0.02) and math.isclose(p["lo"], -0.02) and math.isclose(p["hi"], -0.02)
    noisy = [x + (0.05 if i % 2 else -0.05) for i, x in enumerate(default)]  # half slower, half faster
    p = arms_report.paired(noisy, default)
    assert p["lo"] < 0 < p["hi"] and p["n"] == 40  # a tie: the interval straddles zero
    assert arms_report.paired([None, 1.0], [2.0, None]) is None  # failed requests are dropped


def test_tuned_against_default_per_workload_and_load(tmp_path):
    res = {"lambda_max": {"W-A": 2.0}, "tuples": {"W-A": "t.json", "W-C": "c.json"}, "arms": {
        "stock": {"A1": _load("W-A", 6.0), "A2": _load("W-A", 6.0), "C1": _load("W-C", 6.0)},
        "pinned-default": {"A1": _load("W-A", 5.0, [5.0, 5.1, 5.2]), "A2": _load("W-A", 5.0),
                           "C1": _load("W-C", 4.0, [4.0, 4.0])},
        "tuned-W-A": {"A1": _load("W-A", 4.0, [4.9, 5.0, 5.1]), "A2": _load("W-A", 6.25)},
        "tuned-W-C": {"C1": _load("W-C", 4.4, [4.4, 4.4])},
        "pinned-default@2": {"A1": _load("W-A", 5.05), "A2": _load("W-A", 4.95), "C1": _load("W-C", 4.2)},
        "vllm-bi": {"A1": _load("W-A", 12.0), "A2": _load("W-A", 12.0), "C1": _load("W-C", 12.0)},
    }}
    (tmp_path / "arms.json").write_text(json.dumps(res))
    rep = arms_report.report(str(tmp_path))
    assert rep["geomean_ratio_to_stock"]["vllm-bi"]["tpot_p50_ms"] == 2.0  # vLLM's batch-invariant mode, an arm
    assert "pinned-default@2" not in rep["geomean_ratio_to_stock"]  # a repeat is not an arm of its own
    out = rep["tuned_vs_default"]
    # W-A: sqrt(4/5 * 6.25/5) = 1.0; W-C: 4.4/4 = 1.1
    assert math.isclose(out["workloads"]["W-A"], 1.0) and math.isclose(out["workloads"]["W-C"], 1.1)
    assert math.isclose(out["loads"]["A1"]["median"], -0.1) and "A2" not in out["loads"]  # A2: no per_request
    assert math.isclose(out["loads"]["C1"]["median"], 0.4)
    # the default's second run (serve_arms.py --tag @2) over its first: the run-to-run drift
    assert math.isclose(out["default_repeat"]["W-A"], math.sqrt(5.05 / 5 * 4.95 / 5))
    assert math.isclose(out["default_repeat"]["W-C"], 1.05)
    md = (tmp_path / "arms.md").read_text()
    assert "second / first p50 TPOT (the run-to-run drift): W-A 0.9999, W-C 1.0500" in md
    assert "| W-A | 1.0000 | A1: -0.100 [-0.100, -0.100] |" in md and "| W-C | 1.1000 | C1: +0.400" in md


def test_a_folder_without_stock_still_compares_tuned_with_default(tmp_path):
    # lease 28 served W-C's default and tuned arms before its stock arm: the report had no loads and
    # raised KeyError 'stock'. The loads come from every arm; only the ratios to stock need stock
    res = {"lambda_max": {}, "tuples": {"W-C": "c.json"}, "arms": {
        "pinned-default": {"C1": _load("W-C", 4.0, [4.0, 4.0]), "C2": _load("W-C", 20.0, [20.0, 20.0])},
        "tuned-W-C": {"C1": _load("W-C", 4.4, [4.4, 4.4]), "C2": _load("W-C", 20.0, [20.0, 20.0])},
    }}
    (tmp_path / "arms.json").write_text(json.dumps(res))
    rep = arms_report.report(str(tmp_path))
    assert rep["loads"] == ["C1", "C2"] and rep["figures"] == []
    assert math.isclose(rep["tuned_vs_default"]["workloads"]["W-C"], math.sqrt(1.1))
    assert rep["geomean_ratio_to_stock"]["pinned-default"]["tpot_p50_ms"] is None
    md = (tmp_path / "arms.md").read_text()
    assert "| C1 | pinned-tuned | 4.40 |" in md
    assert "No stock arm in this folder: no ratios to stock." in md and "ratio to stock:" not in md


def test_the_drift_matrix_off_its_diagonal_with_paired_differences_and_its_figure(tmp_path):
    # lease 35: both workloads' tuples served on both workloads, in a folder with no stock arm; the
    # figure had needed stock, and the report gave only the p50 ratio, with no interval
    res = {"lambda_max": {}, "tuples": {"W-A": "a.json", "W-B": "b.json"}, "arms": {
        "tuned-W-A": {"A3": _load("W-A", 8.0, [8.0, 8.1, 8.2]), "B3": _load("W-B", 20.0, [20.0, 21.0, 22.0])},
        "tuned-W-B": {"A3": _load("W-A", 8.0, [8.0, 8.1, 8.2]), "B3": _load("W-B", 16.0, [18.0, 18.5, 19.0])},
    }}
    (tmp_path / "arms.json").write_text(json.dumps(res))
    rep = arms_report.report(str(tmp_path))
    assert rep["drift"] == {"W-A": {"A3": 1.0, "B3": 1.25}, "W-B": {"A3": 1.0, "B3": 1.0}}
    # off the diagonal only: W-A's tuple on B3 (paired differences 2.0, 2.5, 3.0), W-B's on A3 (0, 0, 0)
    off = rep["drift_paired"]
    assert set(off) == {"W-A", "W-B"} and set(off["W-A"]) == {"B3"} and set(off["W-B"]) == {"A3"}
    assert math.isclose(off["W-A"]["B3"]["median"], 2.5) and off["W-A"]["B3"]["lo"] >= 2.0
    assert off["W-B"]["A3"] == {**off["W-B"]["A3"], "median": 0.0, "lo": 0.0, "hi": 0.0}
    md = (tmp_path / "arms.md").read_text()
    assert "| W-A | 1.000 | 1.250 |" in md and "- tuple of W-A: B3 +2.500 [" in md
    assert rep["figures"] == [str(tmp_path / "fig8.png")] and os.path.getsize(rep["figures"][0]) > 0


def test_a_borrowed_lambda_max_is_named_in_the_report(tmp_path):
    # lease 30 served W-B's default and tuned arms at lease 29's stock rates (serve_arms.py run
    # --lambda-max-from): the report says whose stock run set them
    res = {"lambda_max": {"W-B": 3.005}, "lambda_max_from": {"W-B": "lease29/arms-W-B/arms.json"}, "tuples": {},
           "arms": {"pinned-default": {"B1": _load("W-B", 6.85, [6.8, 6.9])}}}
    (tmp_path / "arms.json").write_text(json.dumps(res))
    rep = arms_report.report(str(tmp_path))
    assert rep["lambda_max_from"] == {"W-B": "lease29/arms-W-B/arms.json"}
    assert "W-B's lambda_max is an earlier folder's stock run: lease29/arms-W-B/arms.json" in (
        tmp_path / "arms.md").read_text()


def test_each_arm_against_vllm_per_workload(tmp_path):
    # lease 29 served vLLM beside Detent's arms on W-B and asked for default / vLLM by hand: the
    # report gives each Detent arm's p50 TPOT and TTFT over vLLM's, geometric mean per workload
    res = {"lambda_max": {"W-B": 3.0}, "tuples": {}, "arms": {
        "stock": {"B1": _load("W-B", 8.0), "B2": _load("W-B", 16.0), "C1": _load("W-C", 7.0)},
        "pinned-default": {"B1": _load("W-B", 6.0), "B2": _load("W-B", 12.0), "C1": _load("W-C", 6.0)},
        "vllm": {"B1": _load("W-B", 4.0), "B2": _load("W-B", 9.0), "C1": _load("W-C", 6.0)},
        "vllm-bi": {"B1": _load("W-B", 8.0)},
    }}
    (tmp_path / "arms.json").write_text(json.dumps(res))
    rep = arms_report.report(str(tmp_path))
    vs = rep["against_vllm"]
    assert set(vs) == {"stock", "pinned-default"}  # vLLM's own arms are not set against it
    assert math.isclose(vs["pinned-default"]["tpot_p50_ms"]["W-B"], math.sqrt(6 / 4 * 12 / 9))
    assert math.isclose(vs["pinned-default"]["ttft_p50_ms"]["W-C"], 1.0)
    assert math.isclose(vs["stock"]["tpot_p50_ms"]["W-B"], math.sqrt(8 / 4 * 16 / 9))
    md = (tmp_path / "arms.md").read_text()
    assert "| pinned-default | 1.414 / 1.414 | 1.000 / 1.000 |" in md
    # without a vLLM arm, nothing
    del res["arms"]["vllm"]
    (tmp_path / "arms.json").write_text(json.dumps(res))
    assert arms_report.report(str(tmp_path))["against_vllm"] == {}


def test_an_arm_served_with_other_server_arguments_is_a_row_of_its_own(tmp_path):
    # arms_gpu.sh SERVER_ARGS="--max-mixed-batched-tokens 8192" TAG=-mix8k stores pinned-default-mix8k:
    # an experiment beside the default, with its own ratios to stock; a second run (@2) stays the drift
    res = {"lambda_max": {"W-B": 3.0}, "tuples": {}, "arms": {
        "stock": {"B1": _load("W-B", 8.0), "B2": _load("W-B", 16.0)},
        "pinned-default": {"B1": _load("W-B", 6.0), "B2": _load("W-B", 12.0)},
        "pinned-default-mix8k": {"B1": _load("W-B", 4.0), "B2": _load("W-B", 16.0)},
        "pinned-default@2": {"B1": _load("W-B", 6.0), "B2": _load("W-B", 12.0)},
    }}
    (tmp_path / "arms.json").write_text(json.dumps(res))
    rep = arms_report.report(str(tmp_path))
    ratios = rep["geomean_ratio_to_stock"]
    assert set(ratios) == {"pinned-default", "pinned-default-mix8k"}
    assert math.isclose(ratios["pinned-default-mix8k"]["tpot_p50_ms"], math.sqrt(4 / 8 * 16 / 16))
    md = (tmp_path / "arms.md").read_text()
    assert "| B1 | pinned-default-mix8k | 4.00 |" in md and "pinned-default@2 |" not in md

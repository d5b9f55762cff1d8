"""benchmarks/serve_load.py's bookkeeping (the runs themselves need a GPU and vLLM)."""
import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import serve_load  # noqa: E402


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

"""`detent battery` in process (detent/battery.py): the cells pass under the
pinned selection and some fail under stock, on the tiny Llama (fp32, CPU)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from detent.battery import OfflineBackend, run_battery
from detent.battery_cells import CELLS, STRONG, select
from detent.cli import main
from engine_helpers import bundle, make_llm


def test_the_battery_has_the_papers_cells():
    assert Counter(c.group for c in CELLS) == {"rerun": 2, "cobatch": 14, "row": 4, "prefix_split": 6}
    assert len(STRONG) == 9 and {(c.kind, c.neighbours) for c in STRONG} == \
        {(k, n) for k in ("short", "long", "mixed") for n in (1, 8, 32)}
    assert len({c.name for c in select("all")}) == 35


def _quick(selection: str):
    b = bundle("llama")
    llm = make_llm(b, selection, max_num_batched_tokens=32, max_model_len=512)
    return run_battery(OfflineBackend(llm), select("quick"))


def test_quick_cells_pass_pinned():
    results = _quick("pinned")
    assert len(results) == 6
    assert all(r.passed for r in results), [(r.cell, r.differences) for r in results if not r.passed]


def test_quick_cells_fail_under_stock():
    failed = [r for r in _quick("stock") if not r.passed]
    assert failed, "stock selection passed every quick cell: the battery cannot detect a break"
    assert all(d for r in failed for d in r.differences.values())


@pytest.mark.slow
def test_cli_writes_json_and_exits_by_result(tmp_path):
    from detent.models.tiny import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    out = tmp_path / "b.json"
    assert main(["battery", "--model", model, "--device", "cpu", "--cells", "quick", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["passed"] == rep["total"] == 6 and rep["tuple_hash"] and rep["deployment_hash"]
    assert main(["battery", "--model", model, "--device", "cpu", "--cells", "quick", "--selection", "stock",
                 "--json", str(out)]) == 1
    assert json.loads(out.read_text())["passed"] < 6


def test_cells_by_name_and_a_clear_error_for_an_unknown_one():
    assert [c.name for c in select("rerun,strong_32_long")] == ["rerun", "strong_32_long"]
    with pytest.raises(ValueError, match="unknown cell.*cobatch_99"):
        select("rerun,cobatch_99")


def test_no_server_at_the_url_is_a_clear_error(capsys, tmp_path):
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["battery", "--url", url, "--cells", "quick"]) == 2
    assert f"no detent-serve answers at {url}" in capsys.readouterr().err
    (tmp_path / "r.json").write_text('{"prompt": "x"}')
    (tmp_path / "s.json").write_text('{"choices": [], "detent": {"tuple_hash": "a", "deployment_hash": "b"}}')
    assert main(["verify", "--url", url, "--request", str(tmp_path / "r.json"),
                 "--response", str(tmp_path / "s.json")]) == 2
    assert f"no detent-serve answers at {url}" in capsys.readouterr().err

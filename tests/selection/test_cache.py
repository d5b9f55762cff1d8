"""The on-disk JIT cache: a hit skips solving; the key covers source, facts, version."""
import os
import time

from detent.selection import parse_program, programs, solve
from detent.selection.compiler import jitcache
from tests.selection.conftest import ATTN_SITE, CPU

SRC = "def select(m: Runtime[int]):\n    assume(0 <= m <= 9)\n    return {'x': m // 2}\n"


def test_hit_skips_solving_and_keeps_vra(tmp_path, monkeypatch):
    monkeypatch.setenv("DETENT_SELIR_CACHE", str(tmp_path))
    p = parse_program(SRC)
    a = solve(p, {}, memory=False)
    assert not a.from_cache
    assert a.candidates == {"x": (0, 1, 2, 3, 4)}
    b = solve(p, {}, memory=False)
    assert b.from_cache and b.pins == a.pins and b._vra_data["candidates"] == {"x": (0, 1, 2, 3, 4)}
    assert b.compile({"x": 3})(m=7) == {"x": 3}
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".pkl")]
    assert len(files) == 1


def test_key_changes_with_source_facts_and_options():
    k = jitcache.key(SRC, {"a": 1}, level="full", cut=True)
    assert k == jitcache.key(SRC, {"a": 1}, level="full", cut=True)
    assert k != jitcache.key(SRC + "\n", {"a": 1}, level="full", cut=True)
    assert k != jitcache.key(SRC, {"a": 2}, level="full", cut=True)
    assert k != jitcache.key(SRC, {"a": 1}, level="fold", cut=True)


def test_disabled_and_corrupt_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("DETENT_SELIR_CACHE", "off")
    assert jitcache.cache_dir() is None
    assert not solve(parse_program(SRC), {}, memory=False).from_cache
    monkeypatch.setenv("DETENT_SELIR_CACHE", str(tmp_path))
    p = parse_program(SRC)
    solve(p, {}, memory=False)
    for root, _, fs in os.walk(tmp_path):
        for f in fs:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"not a pickle")
    again = solve(p, {}, memory=False)
    assert not again.from_cache and again.pins == ("x",)


def test_attention_hit_is_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("DETENT_SELIR_CACHE", str(tmp_path))
    facts = {**CPU, **ATTN_SITE}
    cold = solve(programs.load("attention"), facts, memory=False)
    cold.default_assignment()
    t = time.perf_counter()
    hot = solve(programs.load("attention"), facts, memory=False)
    hot.compile(hot.default_assignment())
    assert hot.from_cache
    assert time.perf_counter() - t < 0.5  # benchmarks/selection.py measures it (target 20 ms)

"""The on-disk JIT cache: a hit skips solving; the key covers source, facts, version."""
import os
import time

import pytest

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
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".json")]
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
                fh.write(b"not json")
    with pytest.warns(jitcache.CacheWarning, match="ignored"):
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


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ.get("DETENT_TEST_PWNED", "/nonexistent/x"),))


def _entries(root):
    return [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]


def test_entries_are_data_not_code(tmp_path, monkeypatch):
    """A pickle planted under the cache directory is never loaded: entries are JSON, and a
    hit is checked against the program lowered again."""
    import json
    import pickle
    monkeypatch.setenv("DETENT_SELIR_CACHE", str(tmp_path / "c"))
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("DETENT_TEST_PWNED", str(pwned))
    p = parse_program(SRC)
    solve(p, {}, memory=False)
    (entry,) = _entries(tmp_path / "c")
    assert entry.endswith(".json")
    doc = json.loads(open(entry).read())
    assert doc["format"] == jitcache.FORMAT and "lowered" not in doc["data"]["$dict"]
    k = os.path.basename(entry)[:-5]
    for name in (k + ".pkl", k + ".json"):  # the old pickle name, and over the JSON entry
        with open(os.path.join(os.path.dirname(entry), name), "wb") as f:
            pickle.dump({"lowered": _Boom()}, f)
    with pytest.warns(jitcache.CacheWarning, match="ignored"):
        again = solve(p, {}, memory=False)
    assert not pwned.exists()
    assert not again.from_cache and again.pins == ("x",)
    assert solve(p, {}, memory=False).from_cache  # rewritten as JSON


@pytest.mark.parametrize("edit", ["truncate", "wrong_graph", "bad_pins", "bad_vra", "deep"])
def test_a_corrupt_entry_is_ignored_with_a_warning_and_solved_again(tmp_path, monkeypatch, edit):
    import json
    monkeypatch.setenv("DETENT_SELIR_CACHE", str(tmp_path))
    p = parse_program(SRC)
    first = solve(p, {}, memory=False)
    assert first.candidates == {"x": (0, 1, 2, 3, 4)}
    (entry,) = _entries(tmp_path)
    text = open(entry).read()
    doc = json.loads(text)
    data = doc["data"]["$dict"]
    if edit == "truncate":
        text = text[: len(text) // 2]
    elif edit == "wrong_graph":
        data["graph"] = "0" * 64
    elif edit == "bad_pins":
        data["pins"] = {"$dict": {"x": 10 ** 6}}
    elif edit == "bad_vra":
        data["vra"] = {"$dict": {"candidates": {"$dict": {"x": 3}}}}
    if edit != "truncate":
        text = json.dumps(doc) if edit != "deep" else "{\"format\": \"%s\", \"key\": \"%s\", \"data\": %s}" % (
            jitcache.FORMAT, doc["key"], "[" * 100_000 + "]" * 100_000)
    with open(entry, "w") as f:
        f.write(text)
    with pytest.warns(jitcache.CacheWarning, match="ignored"):
        again = solve(p, {}, memory=False)
    assert not again.from_cache and again.pins == ("x",) and again.candidates == {"x": (0, 1, 2, 3, 4)}


def test_a_hit_in_another_process_matches(tmp_path):
    """Lowering numbers the graph the same way in every process (whatever the str hash seed),
    so an entry written by one process is a hit in the next."""
    import subprocess
    import sys
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from detent.selection import programs, solve\n"
            "from tests.selection.conftest import ATTN_SITE, CPU\n"
            "s = solve(programs.load('attention'), {**CPU, **ATTN_SITE}); s.default_assignment()\n"
            "print(s.from_cache, s.pins)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, DETENT_SELIR_CACHE=str(tmp_path), PYTHONHASHSEED=seed)
        p = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(p.stdout.strip())
    assert outs == ["False ('split_tokens',)", "True ('split_tokens',)"]

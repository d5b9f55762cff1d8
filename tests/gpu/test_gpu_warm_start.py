"""Warm start on the GPU (engine/warmup.py): in a fresh process with an empty
Triton cache, once startup has finished, the first batch-64 pass compiles
nothing and runs within 1.05x of a warm pass; startup is printed with an empty
and with a warm kernel cache.

At Llama-3.1-8B's shapes, and at Qwen3-30B-A3B's (the fused MoE's alignments).

Comparator: the Triton cache's file count with `==` (no compile while
serving); pass times with `<=` 1.05x."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import json, os, time, random
    from detent import LLM, SamplingParams
    cache = os.environ["TRITON_CACHE_DIR"]
    def files():
        return sum(len(f) for _, _, f in os.walk(cache))
    t0 = time.perf_counter()
    llm = LLM(model="{model}", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              warmup={warmup})
    startup = time.perf_counter() - t0
    p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    def batch(seed):
        r = random.Random(seed)
        return [{{"prompt_token_ids": [r.randrange(1000, 30000) for _ in range(1024)]}} for _ in range({batch})]
    before = files()
    times = []
    for seed in (1, 2):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(batch(seed), p, use_tqdm=False)
        times.append(time.perf_counter() - t)
    watch = getattr(llm.llm_engine.runner, "compile_watch", None)
    print("RESULT " + json.dumps({{"startup_s": startup, "first_s": times[0], "warm_s": times[1],
                                  "compiled_while_serving": files() - before,
                                  "watched": [k[:300] for k in watch.kernels] if watch else None}}))
""")


def _run(tmp_path, warmup: bool, model: str = "llama-3.1-8b", batch: int = 64) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"triton-{warmup}"))
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(warmup=warmup, model=model, batch=batch)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_first_pass_after_warm_start_is_warm(tmp_path):
    r = _run(tmp_path, warmup=True)
    print("empty kernel cache:", r)
    assert r["compiled_while_serving"] == 0
    assert r["first_s"] <= 1.05 * r["warm_s"]
    again = _run(tmp_path, warmup=True)  # the same TRITON_CACHE_DIR, now full: startup from a warm cache
    print("warm kernel cache:", again)
    assert again["compiled_while_serving"] == 0


def test_without_warm_start_the_first_pass_compiles(tmp_path):
    """The control: with warm start off, the first pass does compile (so the test above can fail)."""
    r = _run(tmp_path, warmup=False)
    print(r)
    assert r["compiled_while_serving"] > 0


def test_qwen3_moe_first_pass_after_warm_start_compiles_nothing(tmp_path):
    """The same at Qwen3-30B-A3B's shapes (dummy weights; 61 GB of them, so a batch of 32): the
    fused MoE's alignment kernels compile by the step's rows x top_k, and the warm start's probe
    steps reach each one an eager step needs (kernels/moe_triton.py `step_variants`; lease 31's
    tune compiled one, HCH 4096, while it served)."""
    r = _run(tmp_path, warmup=True, model="qwen3-30b-a3b", batch=32)
    print("empty kernel cache:", r)
    assert r["compiled_while_serving"] == 0 and not r["watched"], r

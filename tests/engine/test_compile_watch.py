"""After the warm start a Triton compile is logged and counted (engine/compile_watch.py).

Under the interpreter nothing compiles, so the hook is called here as Triton
calls it (`knobs.runtime.jit_post_compile_hook`, keyword arguments)."""
import logging

import pytest

from detent.engine.compile_watch import CompileWatch, describe, watch_compiles

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def restore_hook():
    before = knobs.runtime.jit_post_compile_hook
    yield
    knobs.runtime.jit_post_compile_hook = before


def _fire(name):
    return knobs.runtime.jit_post_compile_hook(key=(name,), repr=f"{name}[num_warps=4](x: *bf16)", fn=None,
                                               compile={}, is_manual_warmup=False, already_compiled=False)


def test_a_compile_after_warm_start_is_named_and_counted(restore_hook, caplog):
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])  # someone else's hook
    watch = watch_compiles()
    assert isinstance(watch, CompileWatch) and knobs.runtime.jit_post_compile_hook is watch
    with caplog.at_level(logging.WARNING, logger="detent.engine.compile_watch"):
        _fire("_paged_attn_kernel")
        _fire("_combine_kernel")
    assert watch.count == 2 and watch.kernels == ["_paged_attn_kernel[num_warps=4](x: *bf16)",
                                                  "_combine_kernel[num_warps=4](x: *bf16)"]
    assert "compiled while serving" in caplog.text and "_combine_kernel[num_warps=4]" in caplog.text
    assert seen == watch.kernels  # the hook it replaced still runs
    assert watch_compiles() is watch  # a second engine shares it


def test_warm_start_installs_the_watch(restore_hook, monkeypatch):
    import torch

    from detent.engine import startup
    from detent.engine.config import EngineConfig

    class Runner:
        device = torch.device("cpu")

    monkeypatch.setattr("detent.engine.warmup.warm_up", lambda *a, **k: None)
    knobs.runtime.jit_post_compile_hook = None
    r = Runner()
    startup.warm_start(r, EngineConfig(warmup=True), {}, 64)
    assert r.compile_watch is knobs.runtime.jit_post_compile_hook
    r2 = Runner()
    startup.warm_start(r2, EngineConfig(warmup=False), {}, 64)
    assert not hasattr(r2, "compile_watch")


def test_the_log_names_the_constexprs_and_specializations(restore_hook, caplog):
    # what Triton 3.6-3.9 pass: `constants` and `configs` keyed by (argument index,), the
    # signature in argument order; two compiles of one kernel differ only there
    watch = watch_compiles()
    compile = {"signature": {"q_ptr": "*bf16", "num_seqs": "i32", "BLOCK_M": "constexpr", "SHORT": "constexpr"},
               "constants": {(2,): 16, (3,): True}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    with caplog.at_level(logging.WARNING, logger="detent.engine.compile_watch"):
        knobs.runtime.jit_post_compile_hook(key="k", repr="_paged_attn_kernel[num_warps=4](q_ptr: ()", fn=None,
                                            compile=compile, is_manual_warmup=False, already_compiled=False)
    assert "'BLOCK_M': '16'" in watch.kernels[-1] and "'SHORT': 'True'" in watch.kernels[-1]
    assert "'q_ptr': [['tt.divisibility', 16]]" in watch.kernels[-1] and "BLOCK_M" in caplog.text
    garbled = {"signature": None, "constants": 5, "specialization_data": '{"name": "k"}'}
    assert "name" in describe(garbled)


def test_a_second_engines_startup_is_not_serving(restore_hook, caplog):
    # lease 6's RL tests: engines built after the first one logged their own warm start
    from detent.engine.compile_watch import paused
    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"])
    watch = watch_compiles()
    before = watch.count
    with paused():
        _fire("_rms_norm_kernel")
    assert watch.count == before and seen == ["_rms_norm_kernel[num_warps=4](x: *bf16)"]  # still forwarded
    _fire("_rms_norm_kernel")
    assert watch.count == before + 1

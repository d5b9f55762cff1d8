"""CPU tests of the Triton candidates under Triton's interpreter (fp32, tiny shapes).

tests/conftest.py turns the interpreter on before triton is first imported
(on machines without CUDA); the launchers jit on first use per interpreter
state (kernels/common_triton.py). Every output buffer a launcher allocates is
NaN-poisoned first (common_triton.POISON).
"""
import pytest

triton = pytest.importorskip("triton")


def _interpreter_usable() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language.standard as std
    return isinstance(std.sum, InterpretedFunction) or not hasattr(std.sum, "run")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if not _interpreter_usable():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (CUDA machine): run tests/gpu there")
    from detent.kernels import common_triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(common_triton, "POISON", True)
    yield

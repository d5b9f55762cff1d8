"""The DeepGEMM candidate on CPU: what can be checked without DeepGEMM or a GPU.

The not-installed error, the reasons `load_deepgemm` gives, and the
candidate's plumbing (every call sees M = chunk, the tail is zero-padded,
the SM count is set, bias is added) with a stand-in for `deep_gemm` whose
`bf16_gemm_nt` computes D = A @ B.T, checked against float64. DeepGEMM
itself runs in tests/gpu/test_gpu_deepgemm.py.
"""
import importlib.metadata
import sys
import types

import pytest
import torch

from detent.kernels import gemm_deepgemm, registry

BF16 = torch.bfloat16


def test_asking_for_deepgemm_without_it_says_why():
    if "deepgemm" in registry.candidates("gemm"):
        pytest.skip("DeepGEMM runs here")
    installed = True
    try:
        importlib.metadata.version("sgl-deep-gemm")
    except importlib.metadata.PackageNotFoundError:
        installed = False
    why = "needs an sm90 GPU" if installed else r'pip install "detent\[deepgemm\]"'
    with pytest.raises(KeyError, match=r"gemm/deepgemm is not available here: .*" + why):
        registry.get("gemm", "deepgemm")
    from detent.selection import make_dispatcher
    from detent.selection.dispatch import Dispatcher
    from detent.selection.provider import FamilyOverride
    base = make_dispatcher({"device": "cpu"}, "stock")
    d = Dispatcher(FamilyOverride(base.provider, "gemm", {"impl": "deepgemm", "chunk": 256, "num_sms": 132}))
    with pytest.raises(KeyError, match=why):
        d.resolve("gemm", (("n", 48), ("k", 64), ("dtype", "bfloat16")), {"num_tokens": 5})


def _version(v):
    def f(name):
        assert name == "sgl-deep-gemm"
        if v is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return v
    return f


class FailingImport:
    def find_spec(self, name, path=None, target=None):
        if name == "deep_gemm":  # as torch.ops.load_library raises it (the H200 in lease 15)
            try:
                raise OSError("deep_gemm/_C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev")
            except OSError as e:
                raise OSError("Could not load this library: deep_gemm/_C.so") from e


def test_load_deepgemm_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _version(None))
    assert gemm_deepgemm.load_deepgemm() == (None, 'sgl-deep-gemm is not installed: pip install "detent[deepgemm]"')
    monkeypatch.setattr(importlib.metadata, "version", _version("0.2.4"))
    dg, why = gemm_deepgemm.load_deepgemm()
    assert dg is None and "0.2.4 is installed" in why and "0.2.5" in why
    monkeypatch.setattr(importlib.metadata, "version", _version("0.2.5"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gemm_deepgemm.load_deepgemm()[1] == "DeepGEMM's BF16 GEMM candidate needs an sm90 GPU; there is none here"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap in ((8, 0), (10, 0)):  # sm100 has its own DeepGEMM kernel, not the one this candidate was read for
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=cap: c)
        assert gemm_deepgemm.load_deepgemm()[1].endswith(f"this GPU is sm{cap[0]}{cap[1]}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    # what `import deep_gemm` raised on a CPU torch: torch.ops.load_library could not load _C.so
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [FailingImport()] + sys.meta_path)
    dg, why = gemm_deepgemm.load_deepgemm()
    assert dg is None and why.startswith("deep_gemm does not import (OSError: Could not load") and "NVCC >= 12.9" in why
    assert "<- OSError: deep_gemm/_C.so: undefined symbol: _ZN3c104cuda19CUDAErrorLogCaptureC1Ev" in why
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    assert gemm_deepgemm.load_deepgemm()[1].startswith("deep_gemm lacks ['bf16_gemm_nt', 'set_num_sms'")


class FakeDeepGemm(types.ModuleType):
    """bf16_gemm_nt as its contract says: D[M, N] = A[M, K] @ B[N, K].T in bf16."""

    def __init__(self):
        super().__init__("deep_gemm")
        self.ms, self.num_sms = [], 132

    def get_num_sms(self):
        return self.num_sms

    def set_num_sms(self, n):
        self.num_sms = n

    def bf16_gemm_nt(self, a, b, d, c=None, compiled_dims="", alpha=None, epilogue=None):
        assert a.dtype == b.dtype == d.dtype == BF16 and a.is_contiguous() and d.is_contiguous()
        assert d.shape == (a.shape[0], b.shape[0])
        self.ms.append(a.shape[0])
        d.copy_((a.double() @ b.double().T).to(BF16))


@pytest.fixture
def fake(monkeypatch):
    dg = FakeDeepGemm()
    monkeypatch.setattr(gemm_deepgemm, "_DG", dg)
    return dg


@pytest.mark.parametrize("m,chunk", [(1, 64), (64, 64), (100, 64), (129, 64), (77, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_call_sees_one_m_and_rows_match_float64(fake, m, chunk, bias):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 48, generator=g).to(BF16)
    w = (torch.randn(40, 48, generator=g) * 0.1).to(BF16)
    b = torch.randn(40, generator=g).to(BF16) if bias else None
    y = gemm_deepgemm.gemm_deepgemm(x, w, b, chunk=chunk, num_sms=78)
    assert y.shape == (m, 40) and y.dtype == BF16
    assert fake.num_sms == 78
    assert set(fake.ms) == {chunk or m} and len(fake.ms) == -(-m // (chunk or m))
    want = (x.double() @ w.double().T).to(BF16)
    if b is not None:
        want = want + b
    assert torch.equal(y, want)  # the stand-in rounds each row once, so any misplaced row shows


def test_empty_batch_and_bad_arguments(fake):
    w = torch.zeros(8, 16, dtype=BF16)
    assert gemm_deepgemm.gemm_deepgemm(torch.zeros(0, 16, dtype=BF16), w, None, chunk=64, num_sms=132).shape == (0, 8)
    assert fake.ms == []
    with pytest.raises(TypeError, match="bf16"):
        gemm_deepgemm.gemm_deepgemm(torch.zeros(2, 16), w.float(), None, chunk=64, num_sms=132)
    with pytest.raises(ValueError, match="num_sms even"):
        gemm_deepgemm.gemm_deepgemm(torch.zeros(2, 16, dtype=BF16), w, None, chunk=64, num_sms=131)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        gemm_deepgemm.gemm_deepgemm(torch.zeros(2, 8, dtype=BF16), w, None, chunk=64, num_sms=132)


def test_without_deepgemm_loaded_the_call_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gemm_deepgemm, "_DG", None)
    with pytest.raises(RuntimeError, match=r'detent\[deepgemm\]'):
        gemm_deepgemm.gemm_deepgemm(torch.zeros(2, 16, dtype=BF16), torch.zeros(8, 16, dtype=BF16), None,
                                    chunk=64, num_sms=132)


def test_register_makes_it_a_cuda_gemm_candidate(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(gemm_deepgemm, "_DG", None)
    dg = FakeDeepGemm()
    gemm_deepgemm.register_deepgemm(dg)
    cand = registry.get("gemm", "deepgemm")
    assert cand.fn is gemm_deepgemm.gemm_deepgemm and cand.params == ("chunk", "num_sms")
    assert cand.devices == ("cuda",) and gemm_deepgemm._DG is dg

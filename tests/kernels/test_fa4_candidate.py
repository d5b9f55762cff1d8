"""The FlashAttention-4 candidate on CPU: what can be checked without FA4 or a GPU.

The not-installed error, the reasons `load_fa4` gives, the paged-cache
mapping (views, not copies, that gather what the cache holds), and the
candidate's plumbing with a stand-in for FA4's forward that follows FA4's
documented paged semantics, checked against torch SDPA in float64 on the
unpaged sequences. FA4 itself runs in tests/gpu/test_gpu_fa4.py.
"""
import dataclasses
import importlib.metadata

import pytest
import torch
import torch.nn.functional as F

from detent.kernels import attention_fa4, registry
from paged_cases import PagedCase

SCALE = 64 ** -0.5
PINNED = dict(tile_m=192, tile_n=128, num_threads=384, pack_gqa=True, num_splits=1, mma_pv_is_rs=True,
              intra_wg_overlap=True, page_size=16)  # head dim 64 on SM90 (selection/programs/attention.py)


def _fa4_installed_here() -> bool:
    return "fa4" in registry.candidates("attention")


def test_asking_for_fa4_without_it_says_how_to_install():
    if _fa4_installed_here():
        pytest.skip("flash-attn-4 runs here")
    from detent.selection.facts import fa4_version
    # without the package: how to install it; with it but no sm90 GPU here: why not
    why = r'pip install "detent\[fa4\]"' if not fa4_version() else "needs a CUDA GPU of sm90 or newer"
    with pytest.raises(KeyError, match=r"attention/fa4 is not available here: .*" + why):
        registry.get("attention", "fa4")
    # an explicit selection, as a benchmark or experiment would make it
    from detent.selection import make_dispatcher
    from detent.selection.dispatch import Dispatcher
    from detent.selection.provider import FamilyOverride
    base = make_dispatcher({"device": "cpu"}, "stock")
    d = Dispatcher(FamilyOverride(base.provider, "attention", {"impl": "fa4", **PINNED}))
    with pytest.raises(KeyError, match=why):
        d.resolve("attention", (("num_heads", 4),), dict(num_tokens=1, num_seqs=1, max_seqlen_q=1,
                                                        max_seqlen_k=1, total_kv=1))


def test_load_fa4_says_what_is_missing(monkeypatch):
    def version(v):
        def f(name):
            assert name == "flash-attn-4"
            if v is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return v
        return f
    monkeypatch.setattr(importlib.metadata, "version", version(None))
    assert attention_fa4.load_fa4() == (None, 'flash-attn-4 is not installed: pip install "detent[fa4]"')
    monkeypatch.setattr(importlib.metadata, "version", version("4.0.0b30"))
    fwd, why = attention_fa4.load_fa4()
    assert fwd is None and "4.0.0b30 is installed" in why and "4.0.0b36" in why and "detent[fa4]" in why
    monkeypatch.setattr(importlib.metadata, "version", version("4.0.0b36"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert attention_fa4.load_fa4()[1] == "FlashAttention-4 needs an sm90 or newer GPU; there is none here"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert attention_fa4.load_fa4()[1] == "FlashAttention-4 needs an sm90 or newer GPU; this GPU is sm80"


def test_load_fa4_takes_fa4s_forward_where_it_imports(monkeypatch):
    fi = pytest.importorskip("flash_attn.cute.interface")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on an sm90 GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert attention_fa4.load_fa4() == (fi._flash_attn_fwd, None)  # and it takes every argument we pass


def _case_step(dtype=torch.float32, chunks=((0, 40), (30, 33), (70, 71)), order=None):
    case = PagedCase([40, 33, 71], h=8, kvh=2, d=64, dtype=dtype, seed=3)
    cache = torch.zeros(2, case.num_blocks, case.bs, case.kvh, case.d, dtype=dtype)
    case.prefill_prefix(cache, [s for s, _ in chunks])
    q, k, v, meta = case.step(cache, list(chunks), order)
    return case, cache, q, k, v, meta


def test_paged_views_are_the_cache_and_gather_what_it_holds():
    case, cache, q, k, v, meta = _case_step()
    attention_fa4.store_kv(k, v, cache, meta.slot_mapping)
    kv = attention_fa4.paged_views(cache, meta)
    # views of the same memory: FA4 k_cache [num_pages, page_size, KVH, D], no copy
    assert kv.k_pages.shape == (case.num_blocks, 16, 2, 64) and kv.k_pages.data_ptr() == cache.data_ptr()
    assert kv.v_pages.data_ptr() == cache[1].data_ptr() and kv.v_pages.is_contiguous()
    assert kv.page_table is meta.block_tables and kv.seqused_k is meta.seq_lens
    assert kv.cu_seqlens_q is meta.query_start_loc
    for b in range(3):  # FA4's paged read, written out: token p of sequence b is page_table[b, p // P], row p % P
        L = int(kv.seqused_k[b])
        rows = [kv.k_pages[int(kv.page_table[b, p // 16]), p % 16] for p in range(L)]
        assert torch.equal(torch.stack(rows), case.k[b][:L])
        rows = [kv.v_pages[int(kv.page_table[b, p // 16]), p % 16] for p in range(L)]
        assert torch.equal(torch.stack(rows), case.v[b][:L])


def test_paged_views_refuse_what_fa4_cannot_read():
    case, cache, q, k, v, meta = _case_step()
    with pytest.raises(ValueError, match="kv_cache must be"):
        attention_fa4.paged_views(cache[0], meta)
    with pytest.raises(ValueError, match="contiguous"):
        attention_fa4.paged_views(cache.transpose(1, 2), meta)
    bad = dataclasses.replace(meta, block_tables=meta.block_tables.long())
    with pytest.raises(TypeError, match="block_tables must be int32"):
        attention_fa4.paged_views(cache, bad)


def _fake_fa4(calls):
    """A stand-in for interface._flash_attn_fwd with FA4's paged, varlen, causal
    semantics (queries aligned to the end of each sequence's KV), in float64."""
    def fwd(q, k_pages, v_pages, *, cu_seqlens_q, seqused_k, page_table, softmax_scale, causal, **kw):
        calls.append(dict(kw, causal=causal, softmax_scale=softmax_scale))
        out = torch.empty_like(q)
        ps = k_pages.shape[1]
        for b in range(cu_seqlens_q.shape[0] - 1):
            qs, qe, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
            pos = torch.arange(L)
            K = k_pages[page_table[b, pos // ps].long(), pos % ps].double()  # [L, KVH, D]
            V = v_pages[page_table[b, pos // ps].long(), pos % ps].double()
            g = q.shape[1] // K.shape[1]
            s = torch.einsum("qhd,khd->hqk", q[qs:qe].double(), K.repeat_interleave(g, 1)) * softmax_scale
            qpos = torch.arange(L - (qe - qs), L)
            s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), V.repeat_interleave(g, 1)).to(q.dtype)
        return out, None, None, None, None
    return fwd


@pytest.fixture
def fake_fa4(monkeypatch):
    calls = []
    monkeypatch.setitem(registry._REGISTRY, "attention", dict(registry._REGISTRY["attention"]))
    monkeypatch.setattr(attention_fa4, "_FWD", None)
    attention_fa4.register_fa4(_fake_fa4(calls))
    return calls


def test_registered_with_the_parameters_its_selection_reads(fake_fa4):
    c = registry.get("attention", "fa4")
    assert c.fn is attention_fa4.attention_fa4 and c.devices == ("cuda",)
    assert c.params == ("tile_m", "tile_n", "num_threads", "pack_gqa", "num_splits", "mma_pv_is_rs",
                        "intra_wg_overlap", "page_size")
    from detent.selection import programs, solve
    from tests.selection.conftest import GPU
    site = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    s = solve(programs.load("attention"), {**GPU, "fa4": "4.0.0b36", **site})
    sel = s.compile(dict(s.default_assignment(), impl="fa4"))(num_seqs=1, max_seqlen_q=1, max_seqlen_k=9)
    assert sel.pop("impl") == "fa4" and set(sel) == set(c.params)


def test_candidate_passes_the_pinned_selection_and_attends_over_the_pages(fake_fa4):
    # bf16 on CPU: torch only (the stand-in), no Triton
    case, cache, q, k, v, meta = _case_step(torch.bfloat16, order=[2, 0, 1])
    y = attention_fa4.attention_fa4(q, k, v, cache, meta, SCALE, **PINNED)
    (kw,) = fake_fa4
    assert kw == dict(max_seqlen_q=40, max_seqlen_k=71, tile_mn=(192, 128), mma_pv_is_rs=True, intra_wg_overlap=True,
                      num_threads=384, num_splits=1, pack_gqa=True, causal=True, softmax_scale=SCALE)
    # the oracle: torch SDPA in float64 over each sequence's unpaged K/V (its whole prefix)
    off = 0
    for b, (s, e) in [(2, (70, 71)), (0, (0, 40)), (1, (30, 33))]:
        K = case.k[b][:e].double().repeat_interleave(4, 1).transpose(0, 1)
        V = case.v[b][:e].double().repeat_interleave(4, 1).transpose(0, 1)
        mask = torch.arange(e)[None, :] <= torch.arange(s, e)[:, None]
        want = F.scaled_dot_product_attention(case.q[b][s:e].double().transpose(0, 1), K, V, attn_mask=mask,
                                              scale=SCALE).transpose(0, 1)
        # bf16 output against float64: a wrong page, position or head would be off by O(1)
        torch.testing.assert_close(y[off: off + e - s].double(), want, rtol=0, atol=1e-2, msg=str(b))
        off += e - s


def test_candidate_refuses_selections_that_would_break_invariance(fake_fa4):
    case, cache, q, k, v, meta = _case_step(torch.bfloat16)
    with pytest.raises(ValueError, match="num_splits=2"):
        attention_fa4.attention_fa4(q, k, v, cache, meta, SCALE, **{**PINNED, "num_splits": 2})
    with pytest.raises(ValueError, match="page size 64"):
        attention_fa4.attention_fa4(q, k, v, cache, meta, SCALE, **{**PINNED, "page_size": 64})
    with pytest.raises(TypeError, match="bf16 or fp16"):
        attention_fa4.attention_fa4(q.float(), k.float(), v.float(), cache.float(), meta, SCALE, **PINNED)
    assert fake_fa4 == []  # nothing reached FA4


COMPILE_SCRIPT = r'''
import json, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute import interface as I
from detent.kernels.attention_fa4 import PagedKV, call_args
out = []
for c in json.loads(sys.argv[1]):
    sel, (h, kvh, d, page, max_q) = c["sel"], c["shape"]
    with FakeTensorMode():  # FA4 compiles the kernel and skips the launch
        t, dev, bf = 40, "cuda", torch.bfloat16
        kv = PagedKV(torch.empty(64, page, kvh, d, dtype=bf, device=dev), torch.empty(64, page, kvh, d, dtype=bf,
                     device=dev), torch.empty(3, 8, dtype=torch.int32, device=dev),
                     torch.empty(3, dtype=torch.int32, device=dev), torch.empty(4, dtype=torch.int32, device=dev))
        q = torch.empty(t, h, d, dtype=bf, device=dev)
        o = I._flash_attn_fwd(q, kv.k_pages, kv.v_pages, **call_args(kv, max_q, 4096, d ** -0.5, **sel))[0]
        out.append(["ok", list(o.shape), str(o.dtype)])
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow
def test_fa4_compiles_the_pinned_configurations_for_sm90():
    """Where flash_attn.cute imports (a CPU machine too, with nvidia-cutlass-dsl's cu13
    libraries), FA4 compiles for sm_90a, under fake tensors, the kernels the SelIR
    program pins, through the arguments the candidate passes (`call_args`): paged
    through non-TMA (page 16, 64) and TMA (page 128) loads, GQA packed and not, the
    decode (one-tile, persistent) and prefill schedulers. (A split cannot be shown
    asserting here: its scheduler metadata is computed on the device first.)"""
    pytest.importorskip("flash_attn.cute.interface")
    import json
    import os
    import subprocess
    import sys
    from detent.selection import programs, solve
    from tests.selection.conftest import GPU

    configs = []
    for h, kvh, d, page, max_q in ((32, 8, 128, 16, 300), (32, 8, 128, 16, 1), (32, 8, 128, 128, 300),
                                   (8, 2, 64, 64, 300), (16, 16, 128, 16, 1)):
        site = dict(num_heads=h, num_kv_heads=kvh, head_dim=d, block_size=page, dtype="bfloat16")
        s = solve(programs.load("attention"), {**GPU, "fa4": "4.0.0b36", "page_size": page, **site})
        sel = s.compile(dict(s.default_assignment(), impl="fa4"))(num_seqs=3, max_seqlen_q=max_q, max_seqlen_k=4096)
        sel = {k: v for k, v in sel.items() if k not in ("impl", "page_size")}
        configs.append({"sel": sel, "shape": [h, kvh, d, page, max_q]})
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(configs)], env=env, capture_output=True,
                       text=True, timeout=900)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert len(got) == len(configs)
    for c, g in zip(configs, got):
        h, kvh, d = c["shape"][:3]
        assert g == ["ok", [40, h, d], "torch.bfloat16"], (c, g)

import pytest


@pytest.fixture(autouse=True)
def _selir_cache(tmp_path_factory, monkeypatch):
    # never touch ~/.cache from tests: one JIT cache directory per test session
    d = tmp_path_factory.getbasetemp() / "selir-cache"
    monkeypatch.setenv("DETENT_SELIR_CACHE", str(d))
    yield


CPU = dict(device="cpu", triton=False, fa4="", arch="cpu", num_sms=8, dtype="float32", tp=1, page_size=16,
           max_context=4096, max_num_batched_tokens=8192, max_num_seqs=256, hidden=576, num_heads=9,
           num_kv_heads=3, head_dim=64)
GPU = dict(CPU, device="cuda", triton=True, arch="sm90", num_sms=132, dtype="bfloat16", num_heads=32,
           num_kv_heads=8, head_dim=128, hidden=4096, max_context=131072)
ATTN_SITE = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
GEMM_SITE = dict(n=576, k=576, dtype="float32")
MOE_SITE = dict(num_experts=8, top_k=2, hidden=576, intermediate=64, dtype="float32")


def rt(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=1, total_kv=None, message_bytes=0):
    return dict(num_tokens=num_tokens, num_seqs=num_seqs, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                total_kv=total_kv if total_kv is not None else max_seqlen_k, message_bytes=message_bytes)

"""Row-invariance checks of every CPU (torch) candidate, run as a script so a
test can repeat them in a fresh process under each ISA the CPU libraries can
be forced to (ATen's ATEN_CPU_CAPABILITY, MKL's MKL_ENABLE_INSTRUCTIONS and
MKL_CBWR, oneDNN's ONEDNN_MAX_CPU_ISA): those are read once, at load time.

    python tests/kernels/cpu_rowcheck.py   # prints one JSON object

"failures" lists every (candidate, case) whose row bits moved with M, with
the row's position or with its neighbours; "controls" lists the stock
candidates that were caught moving (the checks can fail).
"""
from __future__ import annotations

import json
import sys

import torch

from detent.selection.context import AttentionMetadata
from detent.kernels.act import silu_and_mul_torch
from detent.kernels.attention import attention_paged_split
from detent.kernels.embedding import embedding_torch
from detent.kernels.gemm import gemm_torch, gemm_torch_chunked
from detent.kernels.logsoftmax import log_softmax_torch
from detent.kernels.moe import moe_torch_chunked
from detent.kernels.norm import rms_norm_torch
from detent.kernels.rope import rope_torch
from detent.selection.programs.gemm import CPU_CHUNKS
from detent.selection.programs.moe import CPU_CHUNK

# (K, N): tiny test models' projections, SmolLM2's, and narrow products (N <= 64,
# where MKL's AVX2 kernels are not position-invariant within one shape)
GEMM_SHAPES = ((64, 192), (96, 80), (576, 1536), (128, 4096), (96, 64), (128, 48), (576, 16))
MS = (1, 2, 3, 4, 15, 16, 17, 40)


def _rows_moving(fn, row: torch.Tensor, k: int, g: torch.Generator) -> list[tuple[int, int]]:
    """(M, position) pairs where fn's output row for `row` differs from M = 1."""
    ref = fn(row[None])[0]
    bad = []
    for m in MS:
        for pos in sorted({0, 1 % m, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g)
            x[pos] = row
            if not torch.equal(fn(x)[pos], ref):
                bad.append((m, pos))
    return bad


def check_gemm(out: dict) -> None:
    g = torch.Generator().manual_seed(0)
    for k, n in GEMM_SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        b = torch.randn(n, generator=g)
        row = torch.randn(k, generator=g)
        for chunk in CPU_CHUNKS + (CPU_CHUNK,):
            bad = _rows_moving(lambda x: gemm_torch_chunked(x, w, b, chunk), row, k, g)
            if bad:
                out["failures"].append(f"gemm torch_chunked chunk={chunk} K={k} N={n}: row moved at (M, pos) {bad[:4]}")
        if _rows_moving(lambda x: gemm_torch(x, w, None), row, k, g):
            out["controls"].append(f"gemm torch K={k} N={n}")


def check_moe(out: dict) -> None:
    g = torch.Generator().manual_seed(1)
    e, hdim, inter, top_k = 4, 64, 96, 2
    w13 = torch.randn(e, 2 * inter, hdim, generator=g) * 0.05
    w2 = torch.randn(e, hdim, inter, generator=g) * 0.05
    x = torch.randn(40, hdim, generator=g)
    logits = torch.randn(40, e, generator=g)
    whole = moe_torch_chunked(x, logits, w13, w2, top_k, True, CPU_CHUNK)
    for i in (0, 7, 39):
        alone = moe_torch_chunked(x[i:i + 1], logits[i:i + 1], w13, w2, top_k, True, CPU_CHUNK)[0]
        if not torch.equal(whole[i], alone):
            out["failures"].append(f"moe torch_chunked chunk={CPU_CHUNK}: row {i} of 40 differs from alone")


def _prefill(q, k, v, chunks, split_tokens):
    bs, nb = 4, 64
    cache = torch.zeros(2, nb, bs, k.shape[1], k.shape[2])
    table = torch.arange(1, 1 + -(-q.shape[0] // bs), dtype=torch.int32)
    outs, done = [], 0
    for c in chunks:
        slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(done, done + c)])
        meta = AttentionMetadata(torch.tensor([0, c]), torch.tensor([done + c]), table[None], slots,
                                 1, c, c, done + c, bs, (0, c), (done + c,))
        outs.append(attention_paged_split(q[done:done + c], k[done:done + c], v[done:done + c], cache, meta,
                                          0.25, split_tokens=split_tokens, q_chunk=16))
        done += c
    return torch.cat(outs)


def check_attention(out: dict) -> None:
    g = torch.Generator().manual_seed(2)
    # (heads, KV heads, head dim, tokens, split): a split of 128 keys makes P @ V a narrow
    # product (N = head dim) over K = 128, the shape MKL's AVX2 path computes by row position
    for heads, kv_heads, d, n, split in ((6, 2, 16, 45, 8), (8, 2, 64, 45, 8), (4, 2, 16, 150, 128)):
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
        whole = _prefill(q, k, v, [n], split)
        for cut in ([5, 1, 20, 1, n - 27], [16, n - 16], [3, n - 5, 2]):
            if not torch.equal(whole, _prefill(q, k, v, cut, split)):
                out["failures"].append(f"attention paged_split H={heads} KVH={kv_heads} D={d} split={split}: "
                                       f"chunks {cut[:6]} differ from one prefill")


def check_rowwise(out: dict) -> None:
    g = torch.Generator().manual_seed(3)
    hdim, vocab, m, pos = 96, 1000, 64, 17
    w = torch.randn(hdim, generator=g)
    cos_sin = torch.randn(128, 32, generator=g)
    emb = torch.randn(vocab, hdim, generator=g)
    x, res = torch.randn(m, hdim, generator=g), torch.randn(m, hdim, generator=g)
    q, k = torch.randn(m, 4, 32, generator=g), torch.randn(m, 2, 32, generator=g)
    positions = torch.randint(0, 128, (m,), generator=g)
    logits = torch.randn(m, vocab, generator=g) * 4
    ids = torch.randint(0, vocab, (m,), generator=g)
    cases = {
        "norm": lambda s: rms_norm_torch(x[s], w, 1e-6, None),
        "norm+residual": lambda s: rms_norm_torch(x[s], w, 1e-6, res[s])[0],
        "rope": lambda s: torch.cat([t.flatten(1) for t in rope_torch(q[s], k[s], positions[s], cos_sin)], 1),
        "act": lambda s: silu_and_mul_torch(x[s]),
        "logsoftmax": lambda s: log_softmax_torch(logits[s]),
        "embedding": lambda s: embedding_torch(ids[s], emb),
    }
    for name, fn in cases.items():
        whole = fn(slice(0, m))
        for lo, hi in ((pos, pos + 1), (pos - 3, pos + 5), (0, pos + 1)):
            if not torch.equal(fn(slice(lo, hi))[pos - lo], whole[pos]):
                out["failures"].append(f"{name}: row {pos} of rows [{lo}, {hi}) differs from row {pos} of {m}")


def main() -> dict:
    out = {"aten_capability": torch.backends.cpu.get_cpu_capability(), "failures": [], "controls": []}
    for check in (check_gemm, check_moe, check_attention, check_rowwise):
        check(out)
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout)

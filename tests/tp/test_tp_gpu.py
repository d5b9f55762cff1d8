"""Tensor parallelism on two GPUs (NCCL): run on the device machine.

    python -m pytest -q -m gpu tests/tp/test_tp_gpu.py          # on nvidia-h200-x2

1. The all-reduce candidates over NCCL and torch symmetric memory: a
   token's row reduced alone and inside messages of 64 and 4096 rows (bf16,
   fp32), every rank's bits equal; ordered_gather / one_shot / two_shot
   keep the row's bits; one_shot and two_shot agree bit for bit (the same
   rank-order load-and-reduce). With 2 ranks one add commutes, so `native`
   passes too here; the 4-rank CPU tests show where it fails.
2. `LLM(..., tensor_parallel_size=2)` with dummy weights at real shapes
   (DETENT_TP_GPU_MODEL, default llama-3.1-8b; llama-3.1-70b fits at ~71 GB
   of weights per H200): the battery passes with the pinned selection, and
   stock fails at least one cell (the cells can fail).
"""
from __future__ import annotations

import os

import pytest
import torch

from tp_harness import run_ranks

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("DETENT_TP_GPU_MODEL", "llama-3.1-8b")
CASES = [(1, 0), (64, 17), (4096, 4095)]
HIDDEN = 8192


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")


def _allreduce_rank(rank: int, world: int) -> dict:
    from detent.kernels import registry
    dev = torch.device("cuda", rank)
    out = {}
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator(device=dev).manual_seed(100 + rank)
        row = torch.randn(HIDDEN, generator=g, device=dev).mul_(10.0 ** (rank % 2 * 3)).to(dt)
        for name in ("native", "ordered_gather", "one_shot", "two_shot"):
            fn = registry.get("allreduce", name).fn
            for rows, pos in CASES:
                g2 = torch.Generator(device=dev).manual_seed(1000 * rows + rank)
                msg = torch.randn(rows, HIDDEN, generator=g2, device=dev).to(dt)
                msg[pos] = row
                y = fn(msg, None)
                assert y.shape == msg.shape and y.dtype == dt
                out[(name, str(dt), rows, pos)] = y[pos].cpu()
        out[("partial", str(dt))] = row.cpu()
    torch.cuda.synchronize()
    return out


@pytest.fixture(scope="module")
def nccl_ranks():
    _need_two_gpus()
    return run_ranks(_allreduce_rank, 2, backend="nccl", timeout=300)


@pytest.mark.parametrize("name", ["ordered_gather", "one_shot", "two_shot"])
@pytest.mark.parametrize("dt", ["torch.bfloat16", "torch.float32"])
def test_fixed_order_candidates_keep_row_bits(nccl_ranks, name, dt):
    for res in nccl_ranks:
        alone = res[(name, dt, 1, 0)]
        for rows, pos in CASES:
            assert torch.equal(res[(name, dt, rows, pos)], alone), (rows, pos)
    for rows, pos in CASES:
        assert torch.equal(nccl_ranks[1][(name, dt, rows, pos)], nccl_ranks[0][(name, dt, rows, pos)])
    exact = sum(r[("partial", dt)].double() for r in nccl_ranks)
    tol = 1e-2 if dt == "torch.bfloat16" else 1e-6
    torch.testing.assert_close(nccl_ranks[0][(name, dt, 1, 0)].double(), exact, rtol=tol, atol=tol * 1e3)


@pytest.mark.parametrize("dt", ["torch.bfloat16", "torch.float32"])
def test_one_shot_and_two_shot_agree(nccl_ranks, dt):
    for rows, pos in CASES:
        assert torch.equal(nccl_ranks[0][("one_shot", dt, rows, pos)], nccl_ranks[0][("two_shot", dt, rows, pos)])


# ---------------------------------------------------------------- the engine at tp = 2
def _rank_set_mode(st, mode: str, graphs: bool, max_num_seqs: int) -> str:
    """Install `mode`'s GPU selection on this rank (and recapture its decode
    graphs): SelIR's dispatcher (selection/programs)."""
    from detent.selection import make_dispatcher
    f = st.info.facts
    d = make_dispatcher(f, mode, None)
    site = {"num_heads": f["num_heads"], "num_kv_heads": f["num_kv_heads"],  # per rank
            "head_dim": f["head_dim"], "block_size": f["page_size"], "dtype": f["dtype"]}
    sel = d.provider.selector("attention", site)(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=1,
                                                  total_kv=1)
    assert sel["impl"] == "triton_paged", f"SelIR selected {sel} for attention on CUDA"
    st.runner.dispatcher = d
    if not graphs:
        return "eager"
    from detent.engine.cuda_graph import enable_cuda_graphs
    g = enable_cuda_graphs(st.runner, max_num_seqs=max_num_seqs, max_model_len=st.info.max_model_len)
    return g.disabled or f"graphs {sorted(g.graphs)}"


def _cells(mode: str) -> dict:
    from test_tp_engine import run_cells

    from detent.engine import LLM
    llm = LLM(model=MODEL, tensor_parallel_size=2, load_format="dummy", max_model_len=512, max_num_seqs=8,
              enforce_eager=True, gpu_memory_utilization=0.9, seed=0)
    try:
        status = llm.llm_engine.runner.collective_rpc(_rank_set_mode, mode, True, 8)
        print(f"tp=2 {MODEL} {mode}: {status}")
        return run_cells(llm)
    finally:
        llm.llm_engine.runner.shutdown()


@pytest.fixture(scope="module")
def gpu_cells():
    _need_two_gpus()
    return {mode: _cells(mode) for mode in ("pinned", "stock")}


def test_tp2_gpu_battery_pinned_is_bitwise(gpu_cells):
    cells = gpu_cells["pinned"]
    for name, res in cells.items():
        assert res == cells["alone"], f"cell {name!r} differs from 'alone'"


def test_tp2_gpu_stock_fails_a_cell(gpu_cells):
    cells = gpu_cells["stock"]
    assert [n for n, r in cells.items() if r != cells["alone"]], "stock passed every cell"

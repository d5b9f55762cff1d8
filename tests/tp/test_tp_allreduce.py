"""The all-reduce family on CPU gloo ranks (docs/architecture.md, "Tensor parallelism"; issue 8).

A token's hidden state is one row of the all-reduce's message. The claim:
with `ordered_gather` the row's reduced bits are the same whether it is
reduced alone or inside a message of other tokens (any size, any position),
on every rank; with `native` (gloo's own all-reduce, the stock choice) they
are not, because gloo's ring splits the message into per-rank segments and
the segment an element lands in decides where its ring sum starts.

With 2 ranks each element is one add, which commutes, so every candidate
passes (checked once by hand: gloo at 2 ranks kept every row's bits); that
is why the fixed order is shown with 4 ranks. Comparator: torch.equal. Oracle: numpy
float32 additions in rank order, and float64 sums for tolerance checks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tp_harness import run_ranks

H = 64
# (message rows, position of the token's row); (1, 0) is the token alone
CASES = [(1, 0), (2, 1), (7, 3), (64, 0), (64, 17), (256, 255)]
DTYPES = ("float32", "bfloat16")


def _token_row(rank: int) -> torch.Tensor:
    # partial sums with large cancellation between ranks: the order of the
    # four adds decides the low bits of most elements
    g = torch.Generator().manual_seed(100 + rank)
    scale = (1e4, 1.0, 1e4, 3.0)[rank % 4]
    return torch.randn(H, generator=g, dtype=torch.float64).mul_(scale).float()


def _message(rank: int, rows: int, pos: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rows + 10 * pos + rank)
    msg = torch.randn(rows, H, generator=g) * (1e3 if rank % 2 == 0 else 1.0)
    msg[pos] = _token_row(rank)
    return msg.to(dtype)


def _rank_checks(rank: int, world: int) -> dict:
    """Runs on every rank: each candidate on each (dtype, case); returns the token's rows."""
    from detent.kernels import registry
    from detent.selection import make_dispatcher, ops, use_dispatcher

    out: dict = {"partial": _token_row(rank)}
    for name in ("native", "ordered_gather"):
        fn = registry.get("allreduce", name).fn
        for dt in DTYPES:
            dtype = getattr(torch, dt)
            for rows, pos in CASES:
                y = fn(_message(rank, rows, pos, dtype), None)
                assert y.shape == (rows, H) and y.dtype == dtype
                out[(name, dt, rows, pos)] = y[pos].clone()
    # a non-contiguous 3-D input keeps its shape
    x = _message(rank, 8, 0, torch.float32).view(2, 4, H).transpose(0, 1)
    out["ordered_3d"] = registry.get("allreduce", "ordered_gather").fn(x, None)
    out["ordered_3d_in"] = x.clone()
    # the same through the ops façade, per selection mode
    facts = _facts(world)
    for mode in ("stock", "pinned", "conservative"):
        with use_dispatcher(make_dispatcher(facts, mode)):
            for rows, pos in CASES:
                out[("ops", mode, rows, pos)] = ops.all_reduce(_message(rank, rows, pos, torch.float32))[pos].clone()
    return out


def _rank4_checks(rank: int, world: int, model_dir: str) -> tuple[dict, dict]:
    # one spawn of 4 ranks for both groups of checks (spawning costs seconds per rank)
    return _rank_checks(rank, world), _model_checks(rank, world, model_dir)


@pytest.fixture(scope="module")
def _spawn4(tmp_path_factory):
    import json
    d = tmp_path_factory.mktemp("tp_model")
    (d / "config.json").write_text(json.dumps(TINY))
    return run_ranks(_rank4_checks, 4, str(d))


@pytest.fixture(scope="module")
def ranks4(_spawn4):
    return [r[0] for r in _spawn4]


@pytest.fixture(scope="module")
def model_ranks4(_spawn4):
    return [r[1] for r in _spawn4]


def _facts(world: int) -> dict:
    """The deployment facts the engine would pass (tiny model, CPU, fp32)."""
    from detent.engine.config import EngineConfig, EngineState
    from detent.engine.startup import deployment_facts
    from detent.models import ModelConfig
    cfg = EngineConfig(tensor_parallel_size=world, device="cpu", max_model_len=128)
    state = EngineState(torch.device("cpu"), torch.float32, 128, 64, 16)
    return deployment_facts(cfg, ModelConfig.from_hf(TINY), state)


def _oracle_rank_order(partials: list[torch.Tensor]) -> torch.Tensor:
    acc = partials[0].numpy().astype(np.float32)
    for p in partials[1:]:
        acc = (acc + p.numpy().astype(np.float32)).astype(np.float32)
    return torch.from_numpy(acc)


def _differs_from_alone(res: dict, name: str, dt: str) -> list[tuple[int, int]]:
    alone = res[(name, dt, 1, 0)]
    return [(rows, pos) for rows, pos in CASES[1:] if not torch.equal(res[(name, dt, rows, pos)], alone)]


@pytest.mark.parametrize("dt", DTYPES)
def test_ordered_gather_row_bits_do_not_depend_on_message(ranks4, dt):
    for rank, res in enumerate(ranks4):
        assert _differs_from_alone(res, "ordered_gather", dt) == [], f"rank {rank}"
    for res in ranks4[1:]:  # every rank holds the same bits
        for rows, pos in CASES:
            assert torch.equal(res[("ordered_gather", dt, rows, pos)], ranks4[0][("ordered_gather", dt, rows, pos)])


def test_ordered_gather_is_the_rank_order_fp32_sum(ranks4):
    partials = [r["partial"] for r in ranks4]
    exact = torch.stack(partials).double().sum(0)
    want = _oracle_rank_order(partials)
    got = ranks4[0][("ordered_gather", "float32", 1, 0)]
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-2)
    # bf16: each partial rounded to bf16, summed in fp32 in rank order, cast once
    want_bf16 = _oracle_rank_order([p.to(torch.bfloat16).float() for p in partials]).to(torch.bfloat16)
    assert torch.equal(ranks4[0][("ordered_gather", "bfloat16", 64, 17)], want_bf16)


def test_native_gloo_row_bits_depend_on_message(ranks4):
    """Stock fails: gloo's all-reduce gives the token's row other bits when
    other tokens share the message (the reason the family exists)."""
    for dt in DTYPES:
        differs = _differs_from_alone(ranks4[0], "native", dt)
        assert differs, f"gloo all_reduce ({dt}) was message-size invariant on every case tried"
    # it still computes the sum: only the order (low bits) changes
    exact = torch.stack([r["partial"] for r in ranks4]).double().sum(0)
    for rows, pos in CASES:
        torch.testing.assert_close(ranks4[0][("native", "float32", rows, pos)].double(), exact,
                                   rtol=1e-6, atol=1e-2)


def test_ops_facade_pinned_is_invariant_and_stock_is_not(ranks4):
    res = ranks4[0]
    for mode in ("pinned", "conservative"):
        alone = res[("ops", mode, 1, 0)]
        assert all(torch.equal(res[("ops", mode, r, p)], alone) for r, p in CASES), mode
    alone = res[("ops", "stock", 1, 0)]
    assert not all(torch.equal(res[("ops", "stock", r, p)], alone) for r, p in CASES)


def test_ordered_gather_keeps_shape_of_noncontiguous_input(ranks4):
    want = sum(r["ordered_3d_in"].double() for r in ranks4)
    got = ranks4[0]["ordered_3d"]
    assert got.shape == (4, 2, H)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-2)


# ------------------------------------------------- the whole model at tp = 4
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "eos_token_id": 1, "torch_dtype": "float32"}
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(40)]
NEIGHBOURS = [[(11 * i + k) % 250 + 2 for i in range(n)] for k, n in ((1, 57), (2, 23), (3, 9))]


def _model_checks(rank: int, world: int, model_dir: str) -> dict:
    """Every kernel pinned; only the all-reduce candidate varies. The target's
    prompt logprobs (every prompt row) and its sampled token's logprobs,
    alone vs in a step with three neighbours (a larger all-reduce message)."""
    from detent.engine.config import EngineConfig
    from detent.engine.tp.worker import build_rank
    from detent.models import resolve_model
    from detent.sampling.params import SamplingParams
    from detent.sampling.sampler import SamplingRow
    from detent.scheduler.outputs import ScheduledSeq, SchedulerOutput
    from detent.selection.dispatch import Dispatcher
    from detent.selection.provider import FamilyOverride

    cfg = EngineConfig(model=model_dir, tensor_parallel_size=world, load_format="dummy", device="cpu",
                       max_model_len=128, kv_cache_memory_bytes=1 << 22)
    st = build_rank(cfg, resolve_model(model_dir, "dummy"), rank, world, torch.device("cpu"))
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def seq(rid, ids, first_block):
        blocks = tuple(range(first_block, first_block + -(-len(ids) // 16)))
        return ScheduledSeq(rid, tuple(ids), 0, blocks, SamplingRow(sp, 0, len(ids)), prompt_logprobs_k=5,
                            prompt_rows_start=0, prompt_targets=tuple(ids[1:]))

    alone = SchedulerOutput((seq("t", PROMPT, 1),), len(PROMPT))
    crowd = [seq("n0", NEIGHBOURS[0], 10), seq("t", PROMPT, 1), seq("n1", NEIGHBOURS[1], 20),
             seq("n2", NEIGHBOURS[2], 30)]
    batched = SchedulerOutput(tuple(crowd), sum(s.num_tokens for s in crowd))
    base = st.runner.dispatcher.provider
    out = {}
    for impl in ("ordered_gather", "native"):
        st.runner.dispatcher = Dispatcher(FamilyOverride(base, "allreduce", {"impl": impl}))
        for name, plan in (("alone", alone), ("batched", batched)):
            o = st.runner.execute(plan)
            out[(impl, name)] = (o.sampled["t"], o.prompt_logprobs["t"])
    return out


def test_model_row_bits_with_pinned_allreduce_do_not_depend_on_batch(model_ranks4):
    for res in model_ranks4:
        assert res[("ordered_gather", "alone")] == res[("ordered_gather", "batched")]
        assert res == model_ranks4[0]  # all ranks agree


def test_model_row_bits_with_stock_allreduce_depend_on_batch(model_ranks4):
    """Every other kernel pinned: gloo's all-reduce alone changes the token's logprobs."""
    res = model_ranks4[0]
    assert res[("native", "alone")] != res[("native", "batched")]
    # same values up to rounding
    (a_tok, a_lps), (b_tok, b_lps) = res[("native", "alone")], res[("native", "batched")]
    assert a_tok.token_id == b_tok.token_id
    for x, y in zip(a_lps, b_lps):
        assert abs(x[0] - y[0]) < 1e-4

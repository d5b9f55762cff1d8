"""Small steps with prompt tokens through whole-step CUDA graphs (engine/mixed_graph.py) give
the same bits as eager steps.

The graph runs at T tokens and S sequences >= the step's (the extra rows one more sequence's
in the null block, then empty sequences), attention inside, its selections made at that padded shape; a row's bits must not
see the padding (`torch.equal`). Written before any GPU run (lease 6 built it on CPU)."""
import time

import pytest
import torch

from detent.engine.mixed_graph import MixedGraphRunner
from detent.engine.step_stats import KindCounters
from detent.models.config import ModelConfig
from detent.models.loader import load_model

from test_gpu_cuda_graph import BS, CFG, tiny_mixed_steps

pytestmark = pytest.mark.gpu


def _kinds(llm) -> dict[str, KindCounters]:
    return {k: KindCounters(*v) for k, v in llm.llm_engine.stats()["steps_by_kind"].items()}


def _device_time(kinds: dict[str, KindCounters]) -> float:
    """The device's span of the steps and its idle time before them, over every kind."""
    return sum(k.device_seconds + k.device_idle_seconds for k in kinds.values())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_graph_replay_matches_eager(arch):
    _, model, caches, disp, run = tiny_mixed_steps(arch)
    site = (("num_heads", 8), ("num_kv_heads", 2), ("head_dim", 64), ("block_size", BS), ("dtype", "bfloat16"))

    with torch.inference_mode():
        g = MixedGraphRunner(model, caches, BS, disp, torch.device("cuda"), max_model_len=512,
                             pairs=[(16, 4), (64, 4)], attention_site=site).capture()
        assert g.disabled is None, g.disabled
        assert len(g.graphs) >= 2
        for chunks in ([(0, 10), (0, 17), (0, 30)],  # 57 tokens -> (64, 4)
                       [(10, 40), (16, 17), (59, 60)],  # a chunk beside two decodes
                       [(0, 5), (0, 3), (0, 7)],  # 15 tokens -> (16, 4)
                       [(38, 40), (16, 17), (58, 60)]):  # 2-token chunks: the 16-row tile
            eager = run(chunks)
            replay = run(chunks, g)
            assert replay is not None and torch.equal(replay, eager), chunks
            # filling the static buffers never waits for the device: lease 9 measured a step's
            # fill at 3.7 ms behind the step before it when the padding's sequence was written
            # with `buf[i] = v` (a host copy that synchronizes), 0.7 ms with fill_
            assert torch.equal(run(chunks, g, no_sync=True), eager), chunks
        assert run([(39, 40), (16, 17), (59, 60)], g) is None  # decode-only: the decode graphs'
        assert run([(0, 40), (0, 17), (0, 60)], g) is None  # 117 tokens: larger than every graph


@pytest.mark.parametrize("mode", ["pinned", "stock"])
def test_engine_outputs_with_and_without_mixed_graphs(mode):
    """Whole requests (chunked prompts beside decodes): tokens and logprobs `==` with the
    whole-step graphs on and off. Under stock the padded shape may pick other kernels: reported
    there, asserted for pinned."""
    from detent.engine.llm import LLM
    from detent.sampling.params import SamplingParams

    cfg = ModelConfig.from_hf({**CFG, "vocab_size": 1000, "max_position_embeddings": 1024})
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (300, 45, 700, 9, 130, 260)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)

    def outputs(mixed: int, align: int | None = None, budget: int = 256, cap: int = 64):
        model = load_model(cfg, device="cuda", dtype=torch.bfloat16, load_format="dummy", progress=False, seed=0)
        llm = LLM.from_model(model, cfg, selection=mode, max_model_len=1024, max_num_seqs=8,
                             max_num_batched_tokens=budget, max_mixed_batched_tokens=cap, mixed_token_align=align,
                             mixed_graph_max_tokens=mixed, num_gpu_blocks=512, enable_prefix_caching=False)
        mg = getattr(llm.llm_engine.runner, "mixed_graphs", None)
        assert (mg is not None and mg.disabled is None) == bool(mixed), getattr(mg, "disabled", None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        spans_before = _device_time(_kinds(llm))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        kinds = _kinds(llm)
        mixed_steps = kinds["mixed"]
        # steps that replayed one graph
        assert mixed_steps.steps > 0 and (mixed_steps.whole_graph_steps > 0) == bool(mixed), mixed_steps
        # the device's span and idle time (CUDA events): every kind that ran has a span, and the
        # second generate's spans and gaps fit inside its wall time
        assert all(k.device_seconds > 0 for k in kinds.values() if k.steps), kinds
        assert _device_time(kinds) - spans_before <= wall * 1.05 + 0.05
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    base = outputs(0)
    # the graphs alone, and with the scheduler's alignment (a chunk's tail beside the decodes
    # in a small step of its own: the step the graphs serve); then graphs above 512 tokens
    # (steps of up to 1,024 tokens, chunks beside decodes), against the same budgets eagerly
    same = outputs(64) == base and outputs(64, align=48) == base
    same = same and outputs(1024, budget=1024, cap=1024) == base
    if mode == "pinned":
        assert same
    else:
        print(f"stock: whole-step graphs {'kept' if same else 'changed'} the bits")


def test_graphs_larger_than_max_model_len_start_and_keep_the_bits():
    """max_model_len below the graphs' token count (SmolLM2's GRPO engine: 512 against 2,048)
    died in the capture with an illegal memory access: one capture sequence owned all the rows
    past the rotary and block tables. Now no capture or padding sequence passes max_model_len;
    the graphs start and replay, and the outputs `==` the same engine without them."""
    from detent.engine.llm import LLM
    from detent.sampling.params import SamplingParams

    cfg = ModelConfig.from_hf({**CFG, "vocab_size": 1000, "max_position_embeddings": 1024})
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in torch.randint(3, 17, (24,), generator=gen).tolist()]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)

    def outputs(mixed: int):
        model = load_model(cfg, device="cuda", dtype=torch.bfloat16, load_format="dummy", progress=False, seed=0)
        # sequences of <= 24 tokens, graphs of up to 48: a padded step's extra rows take two sequences
        llm = LLM.from_model(model, cfg, selection="pinned", max_model_len=24, max_num_seqs=16,
                             max_num_batched_tokens=48, max_mixed_batched_tokens=48,
                             mixed_graph_max_tokens=mixed, num_gpu_blocks=256, enable_prefix_caching=False)
        mg = getattr(llm.llm_engine.runner, "mixed_graphs", None)
        assert (mg is not None and mg.disabled is None) == bool(mixed), getattr(mg, "disabled", None)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if mixed:
            assert _kinds(llm)["mixed"].whole_graph_steps > 0  # some steps replayed a graph
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    assert outputs(48) == outputs(0)

"""Prefill and mixed steps through piecewise CUDA graphs give the same bits as eager steps.

The pieces run at a token bucket >= the step's tokens (padded rows), with
attention eager between them on the step's real metadata; a row's bits must
not see the padding or the split (`torch.equal`)."""
import pytest
import torch

from detent.engine.piecewise_graph import PiecewiseGraphRunner
from detent.models.config import ModelConfig
from detent.models.loader import load_model

from test_gpu_cuda_graph import BS, CFG, tiny_mixed_steps

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_piecewise_replay_matches_eager(arch):
    cfg, model, caches, disp, run = tiny_mixed_steps(arch)

    with torch.inference_mode():
        g = PiecewiseGraphRunner(model, caches, BS, disp, torch.device("cuda"), buckets=[16, 64, 128]).capture()
        assert g.disabled is None, g.disabled
        assert len(g.graphs[64]) == cfg.num_layers + 1  # one piece before each attention, one after the last
        for chunks in ([(0, 10), (0, 17), (0, 30)],  # 57 tokens -> bucket 64
                       [(10, 40), (17, 18), (30, 60)],  # mixed: a decode row among prefill chunks
                       [(0, 5), (0, 3), (0, 7)]):  # 15 tokens -> bucket 16
            eager = run(chunks)
            replay = run(chunks, g)
            assert torch.equal(replay, eager), chunks
        assert g.bucket_for(129) is None  # larger steps run eagerly



def test_smaller_buckets_reuse_the_largest_buckets_memory():
    # the buckets are captured on one stream, so the blocks the largest bucket freed serve the
    # smaller ones: eight buckets take about the memory of the largest alone. With a stream per
    # bucket (before lease 25) every bucket kept its own blocks (~9 GiB at Llama-3.1-8B shapes
    # and buckets to 8,192 tokens), and here eight buckets took several times one's memory
    import gc

    cfg, model, caches, disp, run = tiny_mixed_steps("llama")

    def growth(buckets):
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        with torch.inference_mode():
            g = PiecewiseGraphRunner(model, caches, BS, disp, torch.device("cuda"), buckets=buckets).capture()
        assert g.disabled is None, g.disabled
        grown = torch.cuda.memory_reserved() - before
        del g
        return grown

    one = growth([512])
    many = growth(list(range(64, 513, 64)))
    print(f"piecewise graph memory: bucket 512 alone {one / 2**20:.0f} MiB, eight buckets {many / 2**20:.0f} MiB")
    assert many <= 2 * one


@pytest.mark.parametrize("mode", ["pinned", "stock"])
def test_engine_outputs_with_and_without_piecewise_graphs(mode):
    """Whole requests (chunked prompts beside decodes, so mixed steps) through the
    engine: tokens and logprobs `==` with piecewise graphs on and off. Under stock
    selection the padding may pick other kernels; the test reports it there and
    asserts only for pinned."""
    from detent.engine.llm import LLM
    from detent.sampling.params import SamplingParams

    cfg = ModelConfig.from_hf({**CFG, "vocab_size": 1000, "max_position_embeddings": 1024})
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=gen).tolist()}
               for n in (300, 45, 700, 9, 130, 260)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)

    def outputs(piecewise: int):
        model = load_model(cfg, device="cuda", dtype=torch.bfloat16, load_format="dummy", progress=False, seed=0)
        llm = LLM.from_model(model, cfg, selection=mode, max_model_len=1024, max_num_seqs=8,
                             max_num_batched_tokens=256, max_mixed_batched_tokens=128,
                             piecewise_max_tokens=piecewise, num_gpu_blocks=512, enable_prefix_caching=False)
        pw = getattr(llm.llm_engine.runner, "piecewise_graphs", None)
        assert (pw is not None and pw.disabled is None) == bool(piecewise)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    same = outputs(256) == outputs(0)
    if mode == "pinned":
        assert same
    else:
        print(f"stock: piecewise graphs {'kept' if same else 'changed'} the bits")

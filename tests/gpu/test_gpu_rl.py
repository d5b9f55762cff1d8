"""RL on the GPU (bf16, Triton candidates, CUDA graphs, async scheduling):
trainer logprobs == rollout logprobs (torch.equal) under pinned and not under
stock; update_weights keeps CUDA graphs valid (generation == a fresh engine
with the new weights); a few GRPO steps match on every token."""
import pytest
import torch

from detent.engine import LLM, SamplingParams
from detent.engine.train_model import TrainerModel
from detent.models.config import ModelConfig
from detent.models.loader import load_model
from detent.rl import GRPOConfig, TargetTokenTask, train_grpo

pytestmark = pytest.mark.gpu
CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 512,
       "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
       "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
       "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def _llm(selection="pinned", seed=0, **kw):
    mc = ModelConfig.from_hf(CFG)
    model = load_model(mc, device="cuda", dtype=torch.bfloat16, load_format="dummy", seed=seed)
    return LLM.from_model(model, mc, device="cuda", selection=selection, max_model_len=512, max_num_seqs=64,
                          max_num_batched_tokens=256, kv_cache_memory_bytes=1 << 28, **kw)


def _rollout(llm, n=12, lens=(5, 120)):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 4096, (int(l),), generator=g).tolist() for l in torch.randint(*lens, (n,), generator=g)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=24, logprobs=0, ignore_eos=True)
                         for i in range(n)], use_tqdm=False)
    return [(p, list(o.outputs[0].token_ids),
             torch.tensor([pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]))
            for p, o in zip(prompts, outs)]


def _matches(llm, cells):
    lps = TrainerModel(llm, checkpoint_layers=True, logprob_chunk=64)(
        [p + c for p, c, _ in cells], [len(p) for p, _, _ in cells])
    return [torch.equal(lp.detach().cpu(), want) for lp, (_, _, want) in zip(lps, cells)]


def test_gpu_trainer_equals_rollout_pinned_not_stock():
    assert all(_matches(_llm("pinned"), _rollout(_llm("pinned"))))
    stock = _llm("stock")
    assert not all(_matches(stock, _rollout(stock)))


def test_gpu_trainer_scores_sequences_longer_than_the_budget():
    """Prompts of 300-480 tokens against a 256-token budget: the rollout's
    prefills and the trainer's scoring are both cut into chunks (differently)."""
    llm = _llm("pinned")
    cells = _rollout(llm, n=6, lens=(300, 480))
    assert all(len(p) + len(c) > 256 for p, c, _ in cells)
    assert all(_matches(llm, cells))
    stock = _llm("stock")
    # the control: 6 rollouts all matched under stock on the H200 (2026-12-01, lease 4), so it
    # takes 16, with more co-batched chunkings for stock's batch-dependent choices to meet
    assert not all(_matches(stock, _rollout(stock, n=16, lens=(300, 480))))


def test_gpu_update_weights_keeps_cuda_graphs_valid():
    llm = _llm(seed=0)
    _rollout(llm)
    new = load_model(ModelConfig.from_hf(CFG), device="cuda", dtype=torch.bfloat16, load_format="dummy", seed=5)
    llm.update_weights([(n, s.dest) for n, s in new.weight_sources().items()])
    got, fresh = _rollout(llm), _rollout(_llm(seed=5))
    assert all(a[1] == b[1] and torch.equal(a[2], b[2]) for a, b in zip(got, fresh))


def test_gpu_grpo_steps_match_every_token():
    logs = train_grpo(_llm(rl=True), TargetTokenTask(4096),
                      GRPOConfig(steps=3, prompts_per_step=4, group_size=4, max_tokens=16, lr=1e-4))
    assert all(log.match_rate == 1.0 and log.max_abs_diff == 0.0 for log in logs), logs

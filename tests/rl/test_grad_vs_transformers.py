"""The trainer's gradients against transformers' on the same weights.

A tiny checkpoint is built and saved by transformers; Detent loads it, and
both compute the same loss (a fixed random weighting of the completion
tokens' logprobs of two packed sequences) and its gradient for every
checkpoint tensor. Stated tolerances, per tensor, relative to the largest
|gradient| of that tensor: float32 max |diff| <= 1e-5 (measured <= 2.4e-6); bfloat16 (Detent's
engine and trainer in bf16, backward in fp32, against transformers in
float32) relative L2 error <= 0.1 (measured 0.026-0.053; bf16 rounding of the weights and
activations alone moves a tiny MoE expert's gradient by ~5%). The same holds
when a 5-token budget makes the trainer score the sequences in chunks."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from detent.engine import LLM
from detent.engine.train_model import TrainerModel
from detent.models import ModelConfig, load_model
from test_parity import CASES, make_checkpoint

SEQS = [[5, 17, 3, 99, 42, 7, 8, 11, 60], [(i * 37 + 11) % 120 for i in range(14)]]
PROMPT = [4, 6]


def _coef(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _hf_grads(ref) -> dict[str, torch.Tensor]:
    ref.zero_grad()
    loss = 0.0
    for j, (s, p) in enumerate(zip(SEQS, PROMPT)):
        lp = torch.log_softmax(ref(torch.tensor([s])).logits[0].float(), -1)  # [L, V]
        chosen = lp[p - 1:len(s) - 1].gather(1, torch.tensor(s[p:])[:, None])[:, 0]
        loss = loss + (chosen * _coef(len(s) - p, j)).sum()
    loss.backward()
    out = {}
    for n, p in ref.named_parameters():
        if n.endswith("experts.gate_up_proj"):  # transformers fuses the experts: [E, 2I, H], gate first
            i = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{n[:-12]}{e}.gate_proj.weight"], out[f"{n[:-12]}{e}.up_proj.weight"] = p.grad[e, :i], p.grad[e, i:]
        elif n.endswith("experts.down_proj"):  # [E, H, I]
            for e in range(p.shape[0]):
                out[f"{n[:-9]}{e}.down_proj.weight"] = p.grad[e]
        else:
            out[n] = p.grad
    return out


def _our_grads(path, dtype, budget: int = 64, checkpoint_layers: bool = True) -> dict[str, torch.Tensor]:
    """budget < len(SEQS[1]): the sequences are scored in chunks over steps (the
    later chunks' attention differentiates into the earlier chunks' K and V)."""
    mc = ModelConfig.from_hf(path)
    model = load_model(mc, path=str(path), dtype=dtype, progress=False)
    llm = LLM.from_model(model, mc, device="cpu", max_model_len=64, num_gpu_blocks=16,
                         max_num_batched_tokens=budget)
    tm = TrainerModel(llm, checkpoint_layers=checkpoint_layers, logprob_chunk=4)
    lps = tm(SEQS, PROMPT)
    sum((lp * _coef(len(lp), j)).sum() for j, lp in enumerate(lps)).backward()
    return tm.checkpoint_grads()


@pytest.fixture(scope="module", params=["llama-gqa4:2-untied", "qwen3-tied-mqa", "qwen3moe-norm-topk"])
def checkpoint(request, tmp_path_factory):
    cls, kw = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param.replace(":", "_"))
    return d, make_checkpoint(d, cls, kw)


def _compare(ours, theirs, dtype):
    assert ours.keys() <= theirs.keys() and len(ours) >= 10
    worst = {}
    for name, g in ours.items():
        h = theirs[name]
        scale = h.abs().max().item()
        if scale == 0:  # an expert no token was routed to
            assert not g.any(), f"{name}: transformers' gradient is zero, ours is not"
            continue
        if dtype == torch.float32:
            worst[name] = (g - h).abs().max().item() / scale
        else:
            worst[name] = ((g.float() - h).norm() / h.norm()).item()
    assert len(worst) >= 10
    tol = 1e-5 if dtype == torch.float32 else 0.1
    bad = {n: f"{e:.2g}" for n, e in worst.items() if not e <= tol}
    assert not bad, f"gradients differ from transformers beyond {tol}: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_transformers(checkpoint, dtype):
    path, ref = checkpoint
    _compare(_our_grads(path, dtype), _hf_grads(ref), dtype)


# budget 5: SEQS (9 and 14 tokens) run in 5 steps as 6 chunks, the two sequences sharing the second
@pytest.mark.parametrize("dtype,checkpoint_layers", [(torch.float32, True), (torch.float32, False),
                                                     (torch.bfloat16, True)])
def test_chunked_sequences_gradients_match_transformers(checkpoint, dtype, checkpoint_layers):
    path, ref = checkpoint
    _compare(_our_grads(path, dtype, budget=5, checkpoint_layers=checkpoint_layers), _hf_grads(ref), dtype)


def test_chunked_gradients_without_the_kv_history_are_caught(checkpoint, monkeypatch):
    """The chunked comparison can fail: if a later chunk's attention did not
    differentiate into the earlier chunks' K and V (the history's tensors
    detached), the gradients are wrong and the comparison says so."""
    from detent.selection.autograd import StepKV
    prior = StepKV.prior

    def detached(self, kv_cache, before):
        ks, vs, counts = prior(self, kv_cache, before)
        return [k.detach() for k in ks], [v.detach() for v in vs], counts
    monkeypatch.setattr(StepKV, "prior", detached)
    path, ref = checkpoint
    with pytest.raises(AssertionError, match="beyond"):
        _compare(_our_grads(path, torch.float32, budget=5), _hf_grads(ref), torch.float32)


def test_a_wrong_gradient_is_detected(checkpoint):
    """The comparison can fail: a scaled gradient of one tensor exceeds the tolerance."""
    path, ref = checkpoint
    ours = _our_grads(path, torch.float32)
    name = next(n for n in ours if "mlp" in n or "experts" in n)
    ours[name] = ours[name] * 1.01
    with pytest.raises(AssertionError, match="beyond"):
        _compare(ours, _hf_grads(ref), torch.float32)


def test_hidden_states_match_transformers(checkpoint):
    """`hidden_states` (the LM head's input at each scored row, for a loss of
    one's own) against transformers' last hidden state in float32, max |diff|
    <= 1e-5 of the largest |value| (measured 6.6e-7); the same bits whether or not the
    sequences were chunked (budget 5 or 64); and gradients reach the weights."""
    path, ref = checkpoint
    mc = ModelConfig.from_hf(path)
    got = []
    for budget in (64, 5):
        model = load_model(mc, path=str(path), dtype=torch.float32, progress=False)
        llm = LLM.from_model(model, mc, device="cpu", max_model_len=64, num_gpu_blocks=16,
                             max_num_batched_tokens=budget)
        tm = TrainerModel(llm)
        got.append(tm.hidden_states(SEQS, PROMPT))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(*got))
    for h, s, p in zip(got[0], SEQS, PROMPT):
        with torch.no_grad():
            want = ref.model(torch.tensor([s])).last_hidden_state[0, p - 1:len(s) - 1]
        assert h.shape == want.shape
        assert (h.detach() - want).abs().max() <= 1e-5 * want.abs().max()
    sum(h.square().sum() for h in got[1]).backward()
    grads = {n: g for n, g in tm.checkpoint_grads().items() if "lm_head" not in n}
    assert all(g is not None for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "self_attn" in n)

"""The sampler on the GPU: launching a step's sampling never waits for the
device (torch.cuda's sync debug mode set to "error": no device read and no
host-to-device copy that waits), top-p's nucleus is the exact one for the
GPU's own probabilities (both candidates, the kernel equal to the reference),
and a row keeps the same tokens alone and among 255 others at Llama-3's
vocabulary. Prints each candidate's time per batch size."""
import os
import sys
import time

import pytest
import torch

from detent.kernels.nucleus import top_p_keep
from detent.kernels.nucleus_triton import top_p_keep_triton
from detent.sampling.params import SamplingParams
from detent.sampling.sampler import SamplingRow, sample_async
from detent.selection import make_dispatcher, use_dispatcher

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sampling"))
from reference import exact_nucleus  # noqa: E402  (the CPU tests' exact oracle)

pytestmark = pytest.mark.gpu
V = 128256
KINDS = [dict(temperature=0.6, top_p=0.9), dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.01, logprobs=5),
         dict(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1),
         dict(temperature=1.0, logit_bias={3: 2.0}, allowed_token_ids=[1, 2, 3], min_tokens=2,
              bad_words_token_ids=[[5, 6]]),
         dict(temperature=0.0, logprobs=3)]


def test_launching_sampling_never_waits_for_the_device():
    dev = torch.device("cuda")
    x = torch.randn(len(KINDS) * 3, V, device=dev) * 4
    # half the rows with their last output token still on the device (async scheduling's pending token)
    rows = [SamplingRow(SamplingParams(seed=i, **KINDS[i % len(KINDS)]), seed=i, position=7,
                        prompt_token_ids=[1, 5, 9], output_token_ids=[5, 4], eos_token_ids=[2], pending=i % 2)
            for i in range(x.shape[0])]
    last = torch.full((x.shape[0],), 5, device=dev)
    with use_dispatcher(make_dispatcher({"device": "cuda", "triton": True}, "pinned")):  # the fused draw
        sample_async(x, rows, last).resolve()  # warm: the first call may load kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = sample_async(x, rows, last)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert pending.resolve().token_ids == sample_async(x, rows, last).resolve().token_ids


@pytest.mark.parametrize("launch", ["levels", "row", "auto"])
def test_top_p_is_exact_and_the_same_for_a_row_alone_and_in_a_batch(monkeypatch, launch):
    """Both candidates of the `top_p` family on the GPU: the kernel's mask (either launch) equals
    the torch reference's (the same softmax, the same integer masses), each is the exact nucleus,
    and a row keeps the same mask alone and among 255 others. Prints each one's time per batch size."""
    from detent.kernels import nucleus_triton
    monkeypatch.setattr(nucleus_triton, "LAUNCH", launch)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, V, device="cuda", generator=g) * torch.linspace(0.05, 8, 256, device="cuda")[:, None]
    top_p = torch.linspace(0.5, 0.99, 256, device="cuda", dtype=torch.float64)
    keep = top_p_keep(x, top_p)
    assert torch.equal(top_p_keep_triton(x, top_p), keep)
    for i in (0, 17, 128, 255):
        for fn in (top_p_keep, top_p_keep_triton):
            assert torch.equal(fn(x[i:i + 1].clone(), top_p[i:i + 1]), keep[i:i + 1]), (fn.__name__, i)
        probs = torch.softmax(x[i], dim=-1).tolist()
        assert keep[i].nonzero().flatten().tolist() == exact_nucleus(probs, float(top_p[i])), i
    for fn in (top_p_keep, top_p_keep_triton):
        for b in (1, 8, 64, 256):
            fn(x[:b], top_p[:b])
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn(x[:b], top_p[:b])
            torch.cuda.synchronize()
            print(f"top-p {fn.__name__} ({launch}) at batch {b}: {(time.perf_counter() - t) / 20 * 1e6:.0f} us")

"""The sampler decides its work from host values: launching a step's sampling
never reads a device value (`.item()`, `bool(tensor)`: aten._local_scalar_dense),
so under async scheduling the host goes on planning the next step while the
device computes. A read here would make the host wait for the whole forward.
(CPU catches reads; host-to-device copies that wait are caught on the GPU by
tests/gpu/test_gpu_sampler_sync.py, under torch.cuda's sync debug mode.)"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detent.sampling.params import SamplingParams
from detent.sampling.sampler import SamplingRow, sample_async

KINDS = {
    "top-p": dict(temperature=0.7, top_p=0.9),
    "top-p flat": dict(temperature=50.0, top_p=0.99),  # the nucleus spans most of the vocabulary
    "top-k + top-p + min-p": dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.01, logprobs=3),
    "penalties": dict(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1),
    "request masks": dict(temperature=1.0, logit_bias={3: 2.0, 7: -1.5}, allowed_token_ids=[1, 2, 3, 7],
                          min_tokens=4, bad_words_token_ids=[[3, 9], [5]]),
    "greedy + logprobs": dict(temperature=0.0, logprobs=2, logprobs_mode="processed"),
}


class DeviceReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pending", [0, 1], ids=["outputs on the host", "last output on the device"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_launching_a_step_reads_no_device_value(kind, pending):
    x = torch.randn(4, 500, generator=torch.Generator().manual_seed(1)) * 3
    rows = [SamplingRow(SamplingParams(seed=i, **KINDS[kind]), seed=i, position=4, prompt_token_ids=[1, 2, 9],
                        output_token_ids=[3, 3], eos_token_ids=[2], pending=pending) for i in range(4)]
    last = torch.tensor([9, 3, 5, 9]) if pending else None  # each row's last input token
    with DeviceReads() as watch:
        out = sample_async(x, rows, last)
    assert watch.reads == 0, f"{kind}: {watch.reads} device reads"
    assert out.resolve().token_ids == sample_async(x, rows, last).resolve().token_ids

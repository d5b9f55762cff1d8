import pytest
import torch

from detent.selection import make_dispatcher, use_dispatcher


@pytest.fixture(autouse=True)
def _cpu_dispatcher():
    # the sampler's logprobs go through ops.log_softmax, which needs an active dispatcher
    with use_dispatcher(make_dispatcher({"device": "cpu"}, "pinned")) as d:
        yield d


@pytest.fixture(autouse=True)
def _one_thread():
    # the shared 2-core machine is busy: OpenMP spin-waits make small int64 ops 10x slower
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tiny_model, engine_helpers


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # tiny models are op-overhead bound: one intra-op thread is faster, and far
    # faster on a shared machine; restored for the other test folders
    prev = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("DETENT_ENGINE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(prev)

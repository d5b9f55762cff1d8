import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
for d in (HERE, os.path.join(HERE, "..", "engine"), os.path.join(HERE, "..", "models")):
    sys.path.insert(0, os.path.abspath(d))  # rl_helpers, engine_helpers, test_parity


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # tiny models are op-overhead bound: one intra-op thread is faster on a shared machine
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)

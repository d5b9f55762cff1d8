import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _cpu_threads():
    # the CI machine has 2 cores; keep results independent of thread count
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("DETENT_TEST_THREADS", "2")))
    yield

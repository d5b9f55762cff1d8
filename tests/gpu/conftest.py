"""GPU tests (@pytest.mark.gpu): run on the device machine, skipped elsewhere.

Each Triton candidate against its torch reference on random bf16 inputs
(outputs NaN-poisoned before launch), and the batch-invariance checks: a
row's bits must not change with M, its neighbours, chunking, or decode vs
prefill. Every invariance check also shows the stock choice failing it.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))  # paged_cases


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    from detent.kernels import common_triton
    monkeypatch.setattr(common_triton, "POISON", True)
    yield

"""logsoftmax: a row-wise kernel with one candidate; its selection reads no batch value."""
from detent.selection.lang import Fact  # noqa: F401


def select(device: Fact[str]):
    return {"impl": "torch_rowwise"}


def conservative(device: Fact[str]):
    return {"impl": "torch_rowwise"}

"""embedding, sampling: row-wise kernels with one candidate; their selection reads no batch value.

One program for both families (`programs.SOURCES`)."""
from detent.selection.compiler.lang import Fact  # noqa: F401


def select(device: Fact[str]):
    return {"impl": "torch_rowwise"}


def conservative(device: Fact[str]):
    return {"impl": "torch_rowwise"}

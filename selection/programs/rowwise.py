"""norm, rope, act, logsoftmax: row-wise kernels; their selection reads no batch value (no pins).

One program for the four families (`programs.SOURCES`): a Triton kernel on CUDA, torch elsewhere."""
from detent.selection.compiler.lang import Fact  # noqa: F401


def select(device: Fact[str], triton: Fact[bool]):
    if device == "cuda" and triton:
        return {"impl": "triton_rowwise"}
    return {"impl": "torch_rowwise"}


def conservative(device: Fact[str], triton: Fact[bool]):
    return select(device, triton)

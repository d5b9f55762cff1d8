"""embedding: a row-wise kernel with one candidate; its selection reads no batch value
(`programs.SOURCES` maps the family here)."""
from detent.selection.compiler.lang import Fact  # noqa: F401


def select(device: Fact[str]):
    return {"impl": "torch_rowwise"}


def conservative(device: Fact[str]):
    return {"impl": "torch_rowwise"}

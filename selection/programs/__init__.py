"""One SelIR program per kernel family. Each file is SelIR source, parsed by
`detent.selection.programs.load(family)` (and also a valid Python module);
the row-wise families share theirs (`SOURCES`)."""
from __future__ import annotations

import functools
import os

from detent.selection.compiler.lang import Program, load_program

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("gemm", "attention", "moe", "allreduce", "norm", "rope", "act", "embedding", "logsoftmax")


# families whose programs are the same text share one file
SOURCES = {"norm": "rowwise", "rope": "rowwise", "act": "rowwise", "logsoftmax": "rowwise",
           "embedding": "rowwise_torch"}


def path(family: str) -> str:
    return os.path.join(HERE, f"{SOURCES.get(family, family)}.py")


@functools.lru_cache(maxsize=None)
def load(family: str) -> Program:
    if family not in FAMILIES:
        raise KeyError(f"no SelIR program for kernel family {family!r} (families: {list(FAMILIES)})")
    return load_program(path(family), family)

"""One SelIR program per kernel family. Each file is SelIR source, parsed by
`detent.selection.programs.load(family)` (and also a valid Python module);
the row-wise families share theirs (`SOURCES`)."""
from __future__ import annotations

import functools
import os

from detent.selection.compiler.lang import Program, load_program

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("gemm", "attention", "moe", "allreduce", "norm", "rope", "act", "embedding", "logsoftmax", "gumbel",
            "top_p")


# families whose programs are the same text share one file (rowwise.py's docstring
# names four; gumbel, the sampler's draw, shares it too: its text is kept as it was so that
# the program's digest, and so every tuple's, stay the same; so does top_p, the nucleus's mask)
SOURCES = {"norm": "rowwise", "rope": "rowwise", "act": "rowwise", "logsoftmax": "rowwise", "gumbel": "rowwise",
           "top_p": "rowwise", "embedding": "rowwise_torch"}


def path(family: str) -> str:
    return os.path.join(HERE, f"{SOURCES.get(family, family)}.py")


@functools.lru_cache(maxsize=None)
def load(family: str) -> Program:
    if family not in FAMILIES:
        raise KeyError(f"no SelIR program for kernel family {family!r} (families: {list(FAMILIES)})")
    return load_program(path(family), family)


GEMM_TILE = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "tma")


def gemm_tile(cfg: tuple) -> dict:
    """A GEMM_TABLE row as the Triton GEMM candidate's keyword parameters."""
    return dict(zip(GEMM_TILE, cfg))


def gemm_tile_configs() -> tuple[dict, ...]:
    """Every tile the GEMM program can pick, plus the ones the sweep measured
    (programs/gemm.py MEASURED), once each: the set whose bits must agree."""
    from detent.selection.programs import gemm
    rows = ([c for _, row in gemm.GEMM_TABLE for c in row.values()] + [c for *_, c in gemm.BANDS]
            + list(gemm.MEASURED))
    return tuple(gemm_tile(c) for c in dict.fromkeys(rows))


def gemm_triton_params(m: int, n: int) -> dict:
    """The Triton GEMM's parameters the program selects at M = m rows and N = n (its Python
    twin, for benchmarks and tests): the tile, and where `wave_split` cuts, the cut and the
    rest's tile."""
    from detent.selection.programs import gemm
    head = gemm.wave_split(m, n)
    kw = gemm_tile(gemm.triton_config(head, n))
    if head < m:
        kw["split_m"] = head
        kw.update({"tail_" + k: v for k, v in gemm_tile(gemm.triton_config(m - head, n)).items()})
    return kw


MOE_TILE = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def moe_tiles() -> dict[int, dict]:
    """The Triton MoE kernel's tiles by the token count they are tuned for
    (programs/moe.py GPU_CONFIGS), as the candidate's keyword parameters."""
    from detent.selection.programs import moe
    return {key: dict(zip(MOE_TILE, cfg)) for key, cfg in moe.GPU_CONFIGS.items()}

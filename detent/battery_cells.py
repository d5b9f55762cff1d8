"""The invariance battery's cells (docs/battery.md): what each cell does to
the target request, independent of how it is run (in process or over HTTP).

A cell is one batch condition. The target request runs alone once per
variant (greedy; temperature 1 with a seed) and then under every cell; a
cell passes when, for both variants, its token ids, chosen-token logprobs
and top-k logprobs equal the alone run's with `==`.

26 cells: 2 reruns, 14 co-batch (short, long, mixed neighbours), 4 rows (the
target's position among 8 requests), 6 prefix-split (the target's prompt
split at different points: by a neighbour admitted ahead of it, which takes
part of a step's token budget so the target's prefill chunks start
elsewhere, or by a prefix-cache hit of a different length). 9 strong cells:
1, 8 and 32 short, long and mixed neighbours.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

TARGET_LEN = 56  # 3.5 blocks of 16: split by budgets and by block-aligned cache hits
TARGET_MAX_TOKENS = 16
TOP_K = 5
TARGET_SEED = 1234


@dataclass(frozen=True)
class Variant:
    name: str
    temperature: float
    seed: int | None


VARIANTS = (Variant("greedy", 0.0, None), Variant("seeded_t1", 1.0, TARGET_SEED))


@dataclass(frozen=True)
class Cell:
    name: str
    group: str  # rerun | cobatch | row | prefix_split | strong
    condition: str  # one line for the table
    kind: str = ""  # neighbour lengths: short | long | mixed
    neighbours: int = 0
    row: int | None = None  # the target's position among the requests; None = last
    lead: int = 0  # prefix_split: a neighbour of this many tokens admitted just before the target
    prefix: int = 0  # prefix_split: the cache is warmed with the target's first `prefix` tokens
    after_traffic: bool = False  # rerun: other requests ran in between


def _cobatch(kind: str, n: int, group: str = "cobatch") -> Cell:
    return Cell(f"{group}_{n}_{kind}", group, f"{n} {kind} neighbour(s) in the same batch", kind, n)


def _row(name: str, row: int) -> Cell:
    return Cell(f"row_{name}", "row", f"target at position {row} of 8 requests", "mixed", 7, row=row)


CELLS: tuple[Cell, ...] = (
    Cell("rerun", "rerun", "the same request again (prefix cache reset)"),
    Cell("rerun_after_traffic", "rerun", "again, after 8 other requests ran", after_traffic=True),
    *[_cobatch("short", n) for n in (1, 2, 4, 8, 16)],
    *[_cobatch("long", n) for n in (1, 2, 4, 8)],
    *[_cobatch("mixed", n) for n in (1, 3, 7, 15, 31)],
    _row("0", 0), _row("1", 1), _row("middle", 4), _row("last", 7),
    *[Cell(f"split_lead_{k}", "prefix_split", f"a {k}-token request admitted first shifts the prefill chunks",
           lead=k, prefix=p) for k, p in ((5, 8), (13, 40), (27, 48))],
    *[Cell(f"split_cache_{p}", "prefix_split", f"prefix-cache hit on the first {p} prompt tokens", prefix=p)
      for p in (16, 32, 24)],
)
STRONG: tuple[Cell, ...] = tuple(_cobatch(k, n, "strong") for k in ("short", "long", "mixed") for n in (1, 8, 32))
QUICK = ("rerun", "cobatch_1_short", "cobatch_7_mixed", "row_0", "split_lead_13", "split_cache_24")


def select(which: str) -> tuple[Cell, ...]:
    """`all` (26 + 9 strong), `strong` (the 9), `quick` (6 cells, one per kind of
    condition), or cell names separated by commas."""
    if which == "all":
        return CELLS + STRONG
    if which == "strong":
        return STRONG
    if which == "quick":
        return tuple(c for c in CELLS if c.name in QUICK)
    by_name = {c.name: c for c in CELLS + STRONG}
    unknown = [n for n in which.split(",") if n not in by_name]
    if unknown:
        raise ValueError(f"--cells: unknown cell(s) {', '.join(unknown)}; give all, strong, quick or "
                         f"names among {', '.join(by_name)}")
    return tuple(by_name[n] for n in which.split(","))


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn with `seed` from [2, vocab) (0 and 1 are often special)."""
    r = random.Random(seed)
    return [r.randrange(2, vocab) for _ in range(n)]


def target_prompt(vocab: int) -> list[int]:
    return prompt(7, TARGET_LEN, vocab)


def neighbours(cell: Cell, vocab: int) -> list[tuple[list[int], int]]:
    """The cell's other requests: (prompt ids, max_tokens), greedy, seeded by the cell."""
    r = random.Random(f"{cell.name}")
    lens = {"short": lambda: r.randrange(2, 10), "long": lambda: r.randrange(60, 130),
            "mixed": lambda: r.choice([r.randrange(2, 10), r.randrange(15, 50), r.randrange(60, 130)])}
    out = []
    for i in range(cell.neighbours):
        n = lens[cell.kind]()
        out.append((prompt(r.randrange(1 << 30), n, vocab), 4 + (7 * i) % 17))
    return out


def warm_prompt(cell: Cell, vocab: int) -> list[int]:
    """What warms the prefix cache for a split cell: the target's first tokens, then others."""
    return target_prompt(vocab)[:cell.prefix] + prompt(99, 7, vocab)

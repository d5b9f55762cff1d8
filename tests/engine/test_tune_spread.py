"""The search's first rung (`tune_search.spread`) on a family whose knobs are legal one at a
time, as attention's are at Qwen3-30B-A3B's facts on an H100 (lease 34): a long axis, and
two-valued knobs of which a legal assignment changes at most one from the default."""
from __future__ import annotations

import itertools

from detent.selection.compiler.tune_space import FamilySpace
from detent.tune_search import spread

SPLITS = tuple(range(16, 8193, 16))
KNOBS = {"impl": ("fa4", "triton"), "softmax": ("exp", "exp2"), "overlap": (False, True),
         "loop": ("auto", "nested", "prefetch"), "defer": (False, True)}
DEFAULT = {"split": 256, "stride": 256, "impl": "triton", "softmax": "exp2", "overlap": True, "loop": "nested",
           "defer": False}


def one_knob_space() -> FamilySpace:
    legal = []
    for split, stride, *knobs in itertools.product(SPLITS, (64, 256), *KNOBS.values()):
        a = {"split": split, "stride": stride, **dict(zip(KNOBS, knobs))}
        if sum(a[k] != DEFAULT[k] for k in KNOBS) <= 1:
            legal.append(a)
    axes = {"split": SPLITS, "stride": (64, 256), **KNOBS}
    return FamilySpace("attention", ("split",), tuple(axes)[1:], axes, tuple(legal), ("site",))


def test_the_first_rung_tries_every_knobs_other_values_and_spreads_the_long_axis():
    space = one_knob_space()
    cands = spread(space, 32, DEFAULT, ("stride",))
    legal = {space.key(a) for a in space.legal}
    assert cands[0] == DEFAULT and len(cands) <= 32
    assert all(space.key(a) in legal and a["stride"] == 256 for a in cands)
    assert len({space.key(a) for a in cands}) == len(cands)
    for k, vals in KNOBS.items():  # each knob's other values, the rest at the default
        for v in vals:
            assert {**DEFAULT, k: v} in cands, (k, v)
    splits = sorted({a["split"] for a in cands})
    assert len(splits) >= 6 and splits[-1] == SPLITS[-1] and min(splits) <= 256  # spread, both ends
    # the grid alone (halving each axis, a two-valued one kept at its first value) found three points
    assert len(cands) >= 12


def test_a_small_budget_still_starts_from_the_default():
    space = one_knob_space()
    assert spread(space, 1, DEFAULT, ("stride",)) == [DEFAULT]
    few = spread(space, 4, DEFAULT, ("stride",))
    assert few[0] == DEFAULT and len(few) == 4

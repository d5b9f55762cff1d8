"""The whole sampler's outputs under the CPU deployment's selection, and under the same
selection with one family forced to its Triton kernel (interpreted on CPU): the pair a
kernel test compares with `==`."""
from __future__ import annotations

from detent.sampling.sampler import sample
from detent.selection import make_dispatcher, use_dispatcher
from detent.selection.dispatch import Dispatcher
from detent.selection.provider import FamilyOverride


def reference_and_kernel_outputs(logits, rows, family: str) -> list[tuple]:
    """[(tokens, logprobs, ranks, top-k ids, top-k logprobs)] with the torch candidates, then
    with `family` overridden to "triton_rowwise"."""
    base = make_dispatcher({"device": "cpu"}, "pinned")
    fused = Dispatcher(FamilyOverride(base.provider, family, {"impl": "triton_rowwise"}))
    outs = []
    for d in (base, fused):
        with use_dispatcher(d):
            o = sample(logits.clone(), rows)
        outs.append((o.token_ids, o.logprobs, o.ranks, o.topk_ids, o.topk_logprobs))
    return outs

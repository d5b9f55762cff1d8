"""Weight updates into a running engine (`LLM.update_weights`).

New weights arrive in the checkpoint's names (an iterable of (name, tensor)
or a state dict). Everything is checked before anything changes: every name
must be one of the model's checkpoint tensors (or one the loader ignores:
a tied `lm_head.weight`, checked as the embedding it copies, then skipped;
one the loader untied, its copy in the checkpoint differing, is its own weight),
with the checkpoint's full shape, the engine's dtype and finite values, on
a device with data (not meta); otherwise the whole update is refused
with one error naming every problem, and the engine is untouched. Then each
tensor is copied in place into its parameter through the loader's own
`Source` (so each tensor-parallel rank takes its shard), on the same storage:
CUDA graphs captured over the parameters stay valid. The prefix cache is
reset, since its KV was computed by the old weights.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable

import torch


class WeightUpdateError(ValueError):
    """A weight update was refused; the engine's weights did not change."""


class WeightUpdateBusy(WeightUpdateError):
    """Refused because requests are running (retry once they finish)."""


def normalize(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
              ) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    seen, problems = set(), []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise WeightUpdateError(f"update_weights: item {i} is not a (name: str, tensor) pair: {type(item).__name__}")
        if item[0] in seen:
            problems.append(f"{item[0]}: given twice")
        if item[1].is_meta:
            problems.append(f"{item[0]}: a meta-device tensor, which holds no values (materialize it first)")
        seen.add(item[0])
    if not items:
        raise WeightUpdateError("update_weights: no tensors given")
    if problems:
        raise WeightUpdateError("update_weights refused, nothing changed:\n  " + "\n  ".join(problems))
    return items


def metadata(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, shape, dtype, all finite) per tensor: what a rank needs to check an update."""
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), _finite(t)) for n, t in items]


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in t, by one sum: a NaN or inf element makes the sum
    non-finite. The sum accumulates in at least float32, which real weights
    cannot overflow; it is ~10x cheaper than isfinite's mask and reduction."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()))


def problems_for(model: Any, metas: list[tuple[str, tuple[int, ...], str, bool]]) -> list[str]:
    """Every reason the update cannot apply to `model` (empty: it can)."""
    sources = model.weight_sources()
    out = []
    for name, shape, dtype, finite in metas:
        src = sources.get(name) or sources.get(model.tied_copy_of(name))  # a tied copy: checked as its weight
        if src is None:
            if not model.is_ignored(name):
                out.append(f"{name}: not a weight of this model")
            continue
        want = str(src.dest.dtype).removeprefix("torch.")
        if shape != tuple(src.shape):
            out.append(f"{name}: shape {list(shape)}, the checkpoint tensor is {list(src.shape)}")
        if dtype != want:
            out.append(f"{name}: dtype {dtype}, the engine's weights are {want} (cast before sending)")
        if not finite:
            out.append(f"{name}: has NaN or inf values")
    return out


def apply(model: Any, items: list[tuple[str, torch.Tensor]]) -> int:
    """Copy each (already checked) tensor into its parameter, in place; the number copied."""
    sources = model.weight_sources()
    n = 0
    with torch.no_grad():
        for name, t in items:
            src = sources.get(name)
            if src is not None:
                src.load(t)  # this rank's part of the full tensor, copied into the parameter's storage
                n += 1
    return n


def _rank_problems(st, metas):  # collective_rpc: runs on each tensor-parallel rank
    return problems_for(st.runner.model, metas)


def _rank_apply(st, items):
    n = apply(st.runner.model, items)
    if st.runner.device.type == "cuda":
        torch.cuda.synchronize(st.runner.device)
    return n


def _refuse(problems: list[str]) -> None:
    if problems:
        head = problems[:20] + ([f"... ({len(problems)} problems in all)"] if len(problems) > 20 else [])
        raise WeightUpdateError("update_weights refused, nothing changed:\n  " + "\n  ".join(head))


def update_engine(engine: Any, named_tensors) -> int:
    """`LLMEngine.update_weights`: check, copy in place, reset the prefix cache.
    Refused while requests are running (their tokens would mix two policies)."""
    items = normalize(named_tensors)
    metas = metadata(items)
    with engine._step_lock:
        if engine.has_unfinished_requests():
            raise WeightUpdateBusy("update_weights refused while requests are running: finish or abort them "
                                    "first (their outputs would mix old and new weights)")
        if engine._inflight is not None:  # a launched step of finished requests (async scheduling): settle it
            engine._finish_step(engine._inflight)
            engine._inflight = None
        rpc = getattr(engine.runner, "collective_rpc", None)
        if rpc is None:
            _refuse(problems_for(engine.runner.model, metas))
            n = apply(engine.runner.model, items)
        else:  # tensor parallel: every rank checks before any rank copies
            per_rank = rpc(_rank_problems, metas)
            _refuse(sorted({p for ps in per_rank for p in ps}))
            n = rpc(_rank_apply, [(name, t.detach().cpu()) for name, t in items])[0]
        if not engine.block_manager.reset_prefix_cache():
            raise RuntimeError("update_weights: the prefix cache could not be reset (blocks still in use)")
    return n


def update_weights_from_file(engine: Any, path: str) -> int:
    """`engine.update_weights` from a safetensors file or directory (the server's
    route; it runs where the engine lives, in its core process)."""
    return engine.update_weights(tensors_from_safetensors(path))


def tensors_from_safetensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a .safetensors file or checkpoint directory, on the CPU."""
    from detent.models.weights import _open, safetensors_files
    out = []
    for file in safetensors_files(path):
        f = _open(file, "cpu")
        out += [(name, f.get_tensor(name)) for name in f.keys()]
    return out

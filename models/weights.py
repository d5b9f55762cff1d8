"""Filling a model's parameters: strict safetensors loading and dummy weights.

Strict: every checkpoint tensor the model needs must be present with its
full shape, and every tensor in the files must be used (or explicitly
ignored; a tied copy, such as a tied `lm_head.weight`, with the shape of
the weight it copies, and loaded untied where its values differ, as
transformers does); otherwise one error names all missing, unexpected and
misshapen tensors. Pickled checkpoints (`.bin`, `.pt`) are never opened.
"""
from __future__ import annotations

import json
import logging
import math
import os
import zlib
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from detent.models.blocks import CausalLM
from detent.models.layers import Source

INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02
log = logging.getLogger("detent.models")


class CheckpointError(ValueError):
    """A checkpoint does not match the model (names the tensors) or is unreadable."""


def safetensors_files(path: str) -> list[str]:
    """The .safetensors files of a checkpoint directory (sharded via the
    index file, or all *.safetensors) or a single file."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"{path} is not a .safetensors file")
        return [path]
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path} does not exist")
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:  # a trainer's checkpoint may be half-written, or not one: a CheckpointError, not a crash
            with open(index) as f:
                weight_map = json.load(f).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise TypeError("its shard file names must be strings")
        except (ValueError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{index} is not a checkpoint index (a JSON object whose weight_map maps "
                                  f"tensor names to shard files): {e}") from None
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index} lists shard files that are missing: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        pickled = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
        hint = (f" It has pickled weights ({', '.join(pickled[:3])}), which Detent never unpickles"
                f" (arbitrary code execution); convert them to safetensors first." if pickled else "")
        raise CheckpointError(f"no .safetensors files in {path}.{hint}")
    return [os.path.join(path, f) for f in files]


def _open(file: str, device: str):
    try:
        return safe_open(file, framework="pt", device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {file}: not a valid safetensors file "
                              f"(truncated or corrupt?): {e}") from None


def iter_checkpoint(files: list[str], device: str = "cpu") -> Iterator[tuple[str, str, tuple, object]]:
    """(file, name, shape, handle) for every tensor, without reading data."""
    for file in files:
        f = _open(file, device)
        for name in f.keys():
            yield file, name, tuple(f.get_slice(name).get_shape()), f


def load_safetensors(model: CausalLM, path: str, *, device: str = "cpu", progress: bool = True) -> None:
    files = safetensors_files(path)
    sources = model.weight_sources()
    entries = list(iter_checkpoint(files, "cpu" if device == "meta" else str(device)))
    seen: set[str] = set()
    unexpected, bad_shape, copies = [], [], []
    for file, name, shape, _ in entries:
        target = model.tied_copy_of(name)
        if name in sources:
            seen.add(name)
            if shape != sources[name].shape:
                bad_shape.append(f"{name}: checkpoint {list(shape)}, model expects "
                                 f"{list(sources[name].shape)} ({os.path.basename(file)})")
        elif target in sources:  # a tied copy: the shape of the weight it copies
            if shape != sources[target].shape:
                bad_shape.append(f"{name}: checkpoint {list(shape)}, model expects {list(sources[target].shape)}, "
                                 f"the shape of {target} it is tied to ({os.path.basename(file)})")
            copies.append((name, target))
        elif not model.is_ignored(name):
            unexpected.append(name)
    missing = sorted(set(sources) - seen)
    if missing or unexpected or bad_shape:
        raise CheckpointError(_mismatch_message(path, model, missing, sorted(unexpected), bad_shape))
    _untie_differing_copies(model, entries, copies, next(model.parameters()).dtype)
    sources = model.weight_sources()
    bar = _progress(len(entries), progress)
    for file, name, _, handle in entries:
        src = sources.get(name)
        if src is not None:
            try:  # read only this rank's part
                part = handle.get_slice(name)[src.index] if src.index else handle.get_tensor(name)
            except Exception as e:  # noqa: BLE001 - report which file and tensor
                raise CheckpointError(f"cannot read tensor {name} from {file} (truncated?): {e}") from None
            src.load_part(part)
        bar.update(1)
    bar.close()


def _untie_differing_copies(model: CausalLM, entries: list, copies: list[tuple[str, str]], dtype) -> None:
    """A tied copy the checkpoint holds with other values than its weight (both in the model's
    dtype) gets a weight of its own, loaded from the file, as transformers loads it: untied, with
    a warning. Every rank compares the whole tensors, so all decide alike."""
    where = {name: (file, handle) for file, name, _, handle in entries}
    for name, target in copies:
        (file, a), (_, b) = where[name], where[target]
        shape = a.get_slice(name).get_shape()
        step = max(1, (1 << 24) // max(1, math.prod(shape[1:])))  # rows of ~16M values a read
        try:
            if all(torch.equal(a.get_slice(name)[i:i + step].to(dtype), b.get_slice(target)[i:i + step].to(dtype))
                   for i in range(0, shape[0], step)):
                continue
        except Exception as e:  # noqa: BLE001 - report which tensors
            raise CheckpointError(f"cannot read tensor {name} or {target} (truncated?): {e}") from None
        log.warning("%s in %s differs from %s, which tie_word_embeddings ties it to: loaded as a weight of its "
                    "own, as transformers loads it (set tie_word_embeddings to false in the config to say so)",
                    name, file, target)
        model.untie(name)


def _mismatch_message(path, model, missing, unexpected, bad_shape) -> str:
    def some(xs):
        return ", ".join(xs[:8]) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")
    parts = [f"checkpoint {path} does not match {type(model).__name__}:"]
    if missing:
        parts.append(f"missing tensors: {some(missing)}")
    if unexpected:
        parts.append(f"unexpected tensors: {some(unexpected)}")
    if bad_shape:
        parts.append(f"wrong shapes: {some(bad_shape)}")
    return "\n  ".join(parts)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Loading weights", unit="tensor", disable=not enabled or total == 0,
                leave=False)


def dummy_tensors(model: CausalLM, *, seed: int = 0, device: str | torch.device = "cpu"
                  ) -> Iterator[tuple[str, torch.Tensor, Source]]:
    """Random weights at the real shapes, one whole checkpoint tensor at a time:
    norms 1, biases 0, matrices N(0, 0.02), each drawn on `device` from a
    generator keyed by (seed, tensor name), so the values do not depend on
    load order or on the model's device (a `meta` model names the tensors
    for a checkpoint file: benchmarks/wordlevel_model.py)."""
    device = torch.device(device)
    dtype = next(model.parameters()).dtype
    gen = torch.Generator(device=device)
    for name, src in model.weight_sources().items():
        if src.init == "ones":
            t = torch.ones(src.shape, device=device, dtype=dtype)
        elif src.init == "zeros":
            t = torch.zeros(src.shape, device=device, dtype=dtype)
        else:
            gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
            t = torch.randn(src.shape, generator=gen, device=device, dtype=dtype)
            t.mul_(DUMMY_STD)
        yield name, t, src


def init_dummy(model: CausalLM, *, seed: int = 0, device: str | torch.device = "cpu") -> None:
    """Fill the model with `dummy_tensors`, sharded by the same loaders as real
    weights: so a rank's shard equals the slice of the tp=1 tensor."""
    for _, t, src in dummy_tensors(model, seed=seed, device=device):
        src.load(t)
        del t


__all__ = ["CheckpointError", "dummy_tensors", "init_dummy", "load_safetensors", "safetensors_files", "Source"]

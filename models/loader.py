"""`load_model`: build an architecture on the target device and fill its weights."""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from detent.models.config import ModelConfig
from detent.models.layers import TPInfo
from detent.models.registry import model_class
from detent.models.weights import CheckpointError, init_dummy, load_safetensors

# the one list of load formats and dtype names (EngineConfig validates against these)
LOAD_FORMATS = ("auto", "safetensors", "dummy", "gguf")
DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto"/None: the checkpoint's dtype on GPU (bfloat16 when it names none we
    know; float32 checkpoints stay float32), float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return DTYPES.get(config.dtype, torch.bfloat16) if device.type != "cpu" else torch.float32
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}") from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def load_model(config: ModelConfig, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = "auto", load_format: str = "auto",
               path: str | None = None, tp_rank: int = 0, tp_size: int = 1, seed: int = 0,
               tp_group=None, progress: bool = True) -> nn.Module:
    """The model for `config` in eval mode with its weights on `device`.

    load_format: "safetensors" (a directory or file at `path`), "dummy"
    (random weights at the real shapes, no files), "gguf" (a .gguf file at
    `path`, converted once and cached), "auto" (dummy without a path, else
    by what `path` holds)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    device = torch.device(device)
    tdtype = resolve_dtype(dtype, config, device)
    if load_format == "auto":
        if path is None:
            raise ValueError("load_model: load_format='auto' needs a path (use load_format='dummy' "
                             "for random weights)")
        load_format = "gguf" if str(path).endswith(".gguf") else "safetensors"
    if load_format in ("safetensors", "gguf") and path is None:
        raise ValueError(f"load_model: load_format={load_format!r} needs path=")
    if load_format == "gguf":
        from detent.models.gguf import convert_gguf
        path = convert_gguf(path)
    cls = model_class(config.architecture)
    tp = TPInfo(tp_rank, tp_size, tp_group)
    with torch.device(device), _default_dtype(tdtype):
        model = cls(config, tp)
    if load_format == "dummy":
        init_dummy(model, seed=seed, device=device)
    else:
        load_safetensors(model, os.fspath(path), device=str(device), progress=progress)
    return model.eval()


__all__ = ["CheckpointError", "DTYPES", "LOAD_FORMATS", "load_model", "resolve_dtype"]

"""Load the model named by `EngineConfig.model` through models/:
resolve the name, build the architecture on the device, load the tokenizer
(`EngineConfig.tokenizer`'s when given, else the model's)."""
from __future__ import annotations

from typing import Any

import torch

from detent.engine.config import EngineConfig


def load(config: EngineConfig, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """(model, ModelConfig, Tokenizer or None) for a single-process engine."""
    from detent.models import load_model, resolve_model

    resolved = resolve_model(config.model, config.load_format)
    tokenizer = tokenizer_for(resolved, config.tokenizer)  # before the weights: a bad one refuses at once
    mc = resolved.config
    dtype = config.resolve_dtype(mc, device)
    model = load_model(mc, device=device, dtype=dtype, load_format=resolved.load_format,
                       path=resolved.path, seed=config.seed)
    return model, mc, tokenizer


def tokenizer_for(resolved: Any, tokenizer: str | None = None) -> Any:
    """The Tokenizer of a resolved model: from `tokenizer` (a directory or HF cache name) when
    given, else the model's own; None when it has none."""
    from detent.models import Tokenizer, resolve_tokenizer

    source = resolve_tokenizer(tokenizer) if tokenizer is not None else resolved.tokenizer_source
    return Tokenizer.from_pretrained(source) if source else None


def load_tokenizer(model: str | None, load_format: str = "auto", tokenizer: str | None = None) -> Any:
    """The tokenizer `load` gives for this model (and `tokenizer`), without building the model
    (a server whose engine runs in another process)."""
    from detent.models import resolve_model

    return tokenizer_for(resolve_model(model, load_format), tokenizer)


def model_directory(model: str | None, load_format: str = "auto") -> str | None:
    """The directory `model` resolves to, where its config.json and generation_config.json are
    (None: a preset's dummy weights)."""
    from detent.models import resolve_model

    return resolve_model(model, load_format).directory

"""Load the model named by `EngineConfig.model` through models/:
resolve the name, build the architecture on the device, load the tokenizer."""
from __future__ import annotations

from typing import Any

import torch

from detent.engine.config import EngineConfig


def load(config: EngineConfig, device: torch.device) -> tuple[torch.nn.Module, Any, Any]:
    """(model, ModelConfig, Tokenizer or None) for a single-process engine."""
    from detent.models import Tokenizer, load_model, resolve_model

    resolved = resolve_model(config.model, config.load_format)
    mc = resolved.config
    dtype = config.resolve_dtype(mc, device)
    model = load_model(mc, device=device, dtype=dtype, load_format=resolved.load_format,
                       path=resolved.path, seed=config.seed)
    tokenizer = Tokenizer.from_pretrained(resolved.tokenizer_source) if resolved.tokenizer_source else None
    return model, mc, tokenizer


def load_tokenizer(model: str | None, load_format: str = "auto") -> Any:
    """The tokenizer `load` gives for this model, without building the model
    (a server whose engine runs in another process)."""
    from detent.models import Tokenizer, resolve_model

    resolved = resolve_model(model, load_format)
    return Tokenizer.from_pretrained(resolved.tokenizer_source) if resolved.tokenizer_source else None

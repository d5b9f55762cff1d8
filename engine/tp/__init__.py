"""Tensor parallelism: one spawned process per rank, the scheduler in the engine process.

`start_tp(config)` checks that the model shards over N ranks, spawns them,
and returns what `LLMEngine` needs in place of a local model runner: the
model config, the tokenizer, the engine state (KV blocks agreed by all
ranks), the deployment facts and the executor (`execute(plan) ->
ModelOutput`, `shutdown()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from detent.engine.startup import local_kv_heads, max_model_len_for
from detent.engine.tp.executor import TPExecutor, TPWorkerError
from detent.engine.tp.validate import TPConfigError, check_tp_compatible


@dataclass
class TPStartup:
    model_config: Any
    tokenizer: Any
    state: Any  # EngineState
    facts: dict[str, Any]
    executor: TPExecutor


def start_tp(config) -> TPStartup:
    from detent.engine.config import EngineState
    from detent.engine.loader import tokenizer_for
    from detent.models import resolve_model

    resolved = resolve_model(config.model, config.load_format)
    mc = resolved.config
    device = config.resolve_device()
    check_tp_compatible(mc, config.tensor_parallel_size, device)
    max_model_len_for(config, mc)  # refuse a bad max_model_len before spawning
    tokenizer = tokenizer_for(resolved, config.tokenizer)
    executor = TPExecutor(config, resolved)
    info = executor.infos[0]
    state = EngineState(torch.device(info.device), getattr(torch, info.dtype), info.max_model_len,
                        info.num_blocks, config.block_size)
    return TPStartup(mc, tokenizer, state, info.facts, executor)


__all__ = ["TPConfigError", "TPExecutor", "TPStartup", "TPWorkerError", "check_tp_compatible",
           "local_kv_heads", "start_tp"]

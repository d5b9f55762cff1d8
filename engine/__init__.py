"""The engine: offline `LLM`, engine core loop, model runner, KV cache and
block manager, prefix cache, TP workers, trainer forward.

Public names are imported lazily so that light modules (the forward
context) can be imported without pulling in the whole engine.
"""
from __future__ import annotations

_LAZY = {
    "LLM": "detent.engine.llm",
    "SamplingParams": "detent.sampling.params",
    "TokensPrompt": "detent.engine.inputs",
    "TextPrompt": "detent.engine.inputs",
    # a chat message's content as the template's string (LLM.chat and the server's chat route)
    "text_content": "detent.engine.inputs",
    "RequestOutput": "detent.engine.outputs",
    "CompletionOutput": "detent.engine.outputs",
    "Logprob": "detent.engine.outputs",
    "LLMEngine": "detent.engine.llm_engine",
    # the step accounting: stats()["steps_by_kind"] and ["host_seconds"], the server's per-kind series
    "STEP_KINDS": "detent.engine.step_stats",
    "STEP_KIND_FIELDS": "detent.engine.step_stats",
    "HOST_PARTS": "detent.engine.step_stats",
    "EngineConfig": "detent.engine.config",
    "EngineLimits": "detent.engine.config",
    "SELECTION_MODES": "detent.engine.config",
    "ATTENTION_BACKENDS": "detent.engine.config",
    "MIXED_GRAPH_MAX_TOKENS": "detent.engine.config",
    "MIXED_GRAPH_MIN_TOKENS": "detent.engine.config",
    "Fingerprint": "detent.engine.fingerprint",
    "TrainerForward": "detent.engine.trainer",
    "WeightUpdateBusy": "detent.engine.weight_update",
    "WeightUpdateError": "detent.engine.weight_update",
    "tensors_from_safetensors": "detent.engine.weight_update",
    "CheckpointError": "detent.models.weights",
    "CoreProcess": "detent.engine.core_process",
    "DeltaDecoder": "detent.engine.core_process",
    "build_engine": "detent.engine.core_process",
    "freeze_startup_heap": "detent.engine.core_process",
    "load_tokenizer": "detent.engine.loader",
    "model_directory": "detent.engine.loader",
    # `continue_final_message` (LLM.chat and the server's chat requests share it)
    "open_final_message": "detent.models.tokenizer",
    "cut_at_final_message": "detent.models.tokenizer",
    "update_weights_from_file": "detent.engine.weight_update",
    # --profiler-config, POST /start_profile and /stop_profile (server/profile.py)
    "ProfilerConfig": "detent.engine.profiler",
    "start_profile": "detent.engine.profiler",
    "stop_profile": "detent.engine.profiler",
    # the request log and its re-execution (docs/verify.md)
    "RecordError": "detent.engine.log_record",
    "parse_record": "detent.engine.log_record",
    "check_tuple": "detent.engine.log_record",
    # a request's structured-output spec is bounded before the server validates it
    "check_spec_size": "detent.sampling.grammar_limits",
    "check_limits": "detent.sampling.grammar_limits",
    # a server's worker makes admission's checks of a request's params, and its bad-words index
    "checked_params": "detent.sampling.processors",
    # ... and hashes a prompt's blocks for the prefix cache (EngineLimits.block_size)
    "HashedPrompt": "detent.scheduler.block_hash",
    # add_request's refusal when a grammar compile lane is full (the server answers 503)
    "CompileQueueFull": "detent.sampling.grammar_workers",
    "request_record": "detent.engine.log_record",
    "server_record": "detent.engine.log_record",
    "Finding": "detent.engine.replay",
    "refusal_reason": "detent.engine.replay",
    "skip_reason": "detent.engine.replay",
    "compare_output": "detent.engine.replay",
    "verify_report": "detent.engine.replay",
    "describe_difference": "detent.engine.replay",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'detent.engine' has no attribute {name!r}")


__all__ = list(_LAZY)

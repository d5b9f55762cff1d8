"""vLLM `LLM(...)` arguments that Detent does not take, and what it does instead.

Passing one is a ValueError that names it and says what to use, rather than
the bare TypeError an unknown keyword gives: these are arguments people copy
from vLLM code, and each has a Detent answer.
"""
from __future__ import annotations

_SELECTION = "kernels are chosen by SelIR from the commitment tuple: use selection= and tuple= (docs/selir.md)"

INSTEAD = {
    "attention_config": _SELECTION + "; attention_backend= sets the default tuple's attention",
    "kernel_config": _SELECTION,
    "compilation_config": "Detent captures CUDA graphs itself and uses no torch.compile; enforce_eager=True "
                          "turns the graphs off",
    "enable_chunked_prefill": "prefill is always chunked under max_num_batched_tokens "
                              "(and max_mixed_batched_tokens while requests decode)",
    "swap_space": "a preempted request is recomputed, never swapped to CPU memory",
    "cpu_offload_gb": "weights stay on the device; use a smaller model or more tensor_parallel_size",
    "trust_remote_code": "Detent runs no remote code: it implements each architecture it serves "
                         "(Llama, Qwen3, Qwen3-MoE)",
    "quantization": "Detent serves the checkpoint's floating-point weights; choose them with dtype=",
    "kv_cache_dtype": "the KV cache uses the model's dtype (dtype=)",
    "pipeline_parallel_size": "use tensor_parallel_size",
    "distributed_executor_backend": "tensor-parallel ranks are Detent's own processes (tensor_parallel_size=)",
    "speculative_config": "Detent does not decode speculatively",
    "enable_lora": "Detent serves no LoRA adapters",
    "tokenizer_mode": "the model's own tokenizer (tokenizer.json) is used",
}


def refuse_vllm_only(kwargs: dict) -> None:
    """Raise ValueError naming every vLLM-only argument in `kwargs` and its Detent counterpart."""
    given = [k for k in kwargs if k in INSTEAD]
    if given:
        raise ValueError("LLM(): vLLM-only argument(s) " + ", ".join(given) + " not taken by Detent: "
                         + "; ".join(f"{k}: {INSTEAD[k]}" for k in given))

"""Qwen3 dense: the Llama decoder plus per-head RMSNorm on q and k before
rope (`config.qk_norm`, set by ModelConfig for model_type qwen3)."""
from __future__ import annotations

from detent.models.blocks import CausalLM


class Qwen3ForCausalLM(CausalLM):
    pass

"""Llama 2/3.x and Llama-shaped dense models (SmolLM2, Mistral-style without
sliding window): the shared decoder with a SwiGLU MLP and no q/k norm."""
from __future__ import annotations

from detent.models.blocks import CausalLM


class LlamaForCausalLM(CausalLM):
    pass

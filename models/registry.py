"""Model classes by Hugging Face architecture name."""
from __future__ import annotations

from detent.models.blocks import CausalLM
from detent.models.llama import LlamaForCausalLM
from detent.models.qwen3 import Qwen3ForCausalLM
from detent.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}") from None

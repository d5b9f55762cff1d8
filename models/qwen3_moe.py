"""Qwen3-MoE: Qwen3 attention (q/k norm) with a sparse mixture-of-experts MLP
in every layer that `config.layer_is_sparse(i)` (decoder_sparse_step,
mlp_only_layers), a dense SwiGLU elsewhere."""
from __future__ import annotations

from torch import nn

from detent.models.blocks import MLP, CausalLM, SparseMoE
from detent.models.config import ModelConfig
from detent.models.layers import TPInfo


class Qwen3MoeForCausalLM(CausalLM):
    @staticmethod
    def make_mlp(cfg: ModelConfig, layer_idx: int, tp: TPInfo) -> nn.Module:
        if cfg.layer_is_sparse(layer_idx):
            return SparseMoE(cfg, tp)
        return MLP(cfg.hidden_size, cfg.intermediate_size, tp)

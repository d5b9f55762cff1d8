"""A tiny Llama over the `ops` façade, for engine tests only (stands in for
models/ until that lands; kept as a second, independent model afterwards)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from detent.selection import ops


@dataclass(frozen=True)
class TinyConfig:
    architecture: str = "TinyLlama"
    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    eos_token_ids: tuple[int, ...] = (1,)
    dtype: str = "float32"
    num_experts: int = 0


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyConfig, seed: int = 0):
        super().__init__()
        self.config = cfg
        g = torch.Generator().manual_seed(seed)
        h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) * (1.0 / shape[-1] ** 0.5), requires_grad=False)

        self.embed = w(cfg.vocab_size, h)
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = nn.Module()
            layer.ln1, layer.ln2 = nn.Parameter(torch.ones(h), requires_grad=False), nn.Parameter(torch.ones(h), requires_grad=False)
            layer.qkv, layer.o = w(qkv, h), w(h, cfg.num_heads * d)
            layer.gate_up, layer.down = w(2 * i, h), w(h, i)
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.lm_head = w(cfg.vocab_size, h)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        f = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), inv)
        self.register_buffer("cos_sin", torch.cat([f.cos(), f.sin()], -1).float(), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        x = ops.embedding(input_ids, self.embed)  # [T, H]
        residual = None
        for li, layer in enumerate(self.layers):
            if residual is None:
                residual, x = x, ops.rms_norm(x, layer.ln1, cfg.rms_eps)
            else:
                x, residual = ops.rms_norm(x, layer.ln1, cfg.rms_eps, residual)
            qkv = ops.linear(x, layer.qkv)
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            q, k, v = q.view(-1, nh, d), k.view(-1, nkv, d), v.view(-1, nkv, d)  # [T, H, D]
            q, k = ops.rope(q, k, positions, self.cos_sin)
            a = ops.attention(q, k, v, layer_idx=li, scale=d ** -0.5)
            x = ops.linear(a.reshape(-1, nh * d), layer.o)
            x, residual = ops.rms_norm(x, layer.ln2, cfg.rms_eps, residual)
            x = ops.linear(ops.silu_and_mul(ops.linear(x, layer.gate_up)), layer.down)
        x, _ = ops.rms_norm(x, self.norm, cfg.rms_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(hidden, self.lm_head).float()


class ByteTokenizer:
    """Token i <-> chr(32 + i) (ids 0, 1 are BOS/EOS); enough for stop strings."""

    eos_token_id = 1
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(max(ord(c) - 32, 2), 95) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i < 2))

"""Decoder blocks shared by the Llama, Qwen3 and Qwen3-MoE models.

Shapes: T tokens of the step (all sequences back to back), H hidden,
NH / NKV query / KV heads on this rank, D head dim.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from detent.models.config import ModelConfig
from detent.models.layers import (MergedColumnParallelLinear, ParallelLMHead,
                                  QKVParallelLinear, ReplicatedLinear, RMSNorm, RotaryEmbedding,
                                  RowParallelLinear, Source, SourcedModule, TPInfo, VocabParallelEmbedding,
                                  _divide)
from detent.selection import ops


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TPInfo):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.attention_bias, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.rotary = [rotary]  # shared cache; a list so it is not registered as a submodule

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        nh, nkv, d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (NH + 2 NKV) D]
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(t, nh, d)  # [T, NH, D] views into qkv (strided rows: the kernels read them in place)
        k = k.view(t, nkv, d)  # [T, NKV, D]
        v = v.view(t, nkv, d)  # only stored into the KV cache
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's D, before rope
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        o = ops.attention(q, k, v, layer_idx=self.layer_idx, scale=self.scale)  # [T, NH, D]
        return self.o_proj(o.reshape(t, nh * d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, tp: TPInfo):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       ("gate_proj", "up_proj"), tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class FusedExperts(SourcedModule):
    """All experts' SwiGLU weights stacked: w13 [E, 2I/tp, H] ([gate | up]),
    w2 [E, H, I/tp]. Tensor parallelism splits each expert's intermediate dim;
    the partial outputs are summed by ops.all_reduce."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.local = _divide(intermediate, tp.size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)

    def weight_sources(self, leaf: str) -> dict[str, Source]:
        n, s = self.local, self.tp.rank * self.local
        w13, w2 = self.w13.data, self.w2.data
        rows, cols = (slice(s, s + n),), (slice(None), slice(s, s + n))
        full_13, full_2 = (self.intermediate, self.hidden), (self.hidden, self.intermediate)
        out = {}
        for e in range(self.num_experts):
            p = f"{leaf}.{e}"
            out[f"{p}.gate_proj.weight"] = Source(full_13, w13[e, :n], rows)
            out[f"{p}.up_proj.weight"] = Source(full_13, w13[e, n:], rows)
            out[f"{p}.down_proj.weight"] = Source(full_2, w2[e], cols)
        return out


class SparseMoE(nn.Module):
    """Router (softmax over experts, top-k, optional renormalization) + experts."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)  # [T, E]
        y = ops.moe(x, router_logits, self.experts.w13, self.experts.w2, self.top_k, self.renormalize)
        if self.tp.size > 1:
            y = ops.all_reduce(y, self.tp.group)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module,
                 tp: TPInfo):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rotary, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, positions, x, residual):
        # the residual add is fused into the next norm: (norm(x + r), x + r)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, make_mlp, tp: TPInfo):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_dict)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, make_mlp(cfg, i, tp), tp)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """The model contract (docs/architecture.md): `model(input_ids[T], positions[T])
    -> hidden[T, H]` inside a forward context; `compute_logits(hidden[R, H]) ->
    [R, V] float32`. Subclasses choose the MLP of each layer."""

    # checkpoint tensors that are not weights (buffers some exporters save): skipped
    IGNORED_CHECKPOINT_NAMES: tuple[str, ...] = (r"rotary_emb\.inv_freq$",)

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo()):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = DecoderModel(cfg, self.make_mlp, tp)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, tied_to=tied)

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer_idx: int, tp: TPInfo) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches (num_kv_heads / tp, or 1 replica when fewer)."""
        return self.model.layers[0].self_attn.qkv_proj.num_kv_heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Per-layer KV cache shape ops.attention expects on this rank."""
        return (2, num_blocks, block_size, self.num_local_kv_heads, self.config.head_dim)

    def weight_sources(self) -> dict[str, Source]:
        """Every checkpoint tensor this model needs -> where it goes."""
        out: dict[str, Source] = {}
        for name, mod in self.named_modules():
            if isinstance(mod, SourcedModule):
                parent, _, leaf = name.rpartition(".")
                for rel, src in mod.weight_sources(leaf).items():
                    out[f"{parent}.{rel}" if parent else rel] = src
        return out

    def is_ignored(self, name: str) -> bool:
        if self.tied_copy_of(name) is not None:
            return True  # some tied checkpoints still carry a copy
        return any(re.search(p, name) for p in self.IGNORED_CHECKPOINT_NAMES)

    def tied_copy_of(self, name: str) -> str | None:
        """The weight a skipped tied tensor copies (`lm_head.weight`: the embedding), or None."""
        return "model.embed_tokens.weight" if self.lm_head.tied and name == "lm_head.weight" else None

    def untie(self, name: str) -> None:
        """Give the tied copy `name` its own weight, for the loader to fill (a checkpoint whose
        copy differs from the weight it would copy)."""
        if self.tied_copy_of(name) is None:
            raise ValueError(f"{name} is not a tied copy in this model")
        self.lm_head.untie()

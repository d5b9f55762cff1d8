"""Shared layers with tensor-parallel sharding built in.

Every layer that owns parameters also says which checkpoint tensors fill
them (`weight_sources`): the checkpoint name (relative to the layer's
parent module), the tensor's full, unsharded shape, the index of this rank's
part of it, and the parameter view it goes to. The loader reads only that
part from disk. The TP worker only supplies rank,
world size and process group (`TPInfo`); the slicing lives here.

All arithmetic goes through `detent.selection.ops`, never kernels/.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from detent.selection import ops


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group (None: the default group)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank must be in 0..tp_size-1, got rank {self.rank}, size {self.size}")


@dataclass(frozen=True, eq=False)
class Source:
    """One checkpoint tensor feeding (part of) one parameter:
    `dest <- checkpoint[index]`."""
    shape: tuple[int, ...]  # full (unsharded) shape in the checkpoint
    dest: torch.Tensor  # the parameter (or the view of it) this rank fills
    index: tuple[slice, ...] = ()  # this rank's part of the checkpoint tensor
    init: str = "normal"  # dummy init: "normal" (N(0, 0.02)), "ones", "zeros"

    def load_part(self, part: torch.Tensor) -> None:
        """Copy the already-indexed part (what `checkpoint[index]` gives)."""
        if tuple(part.shape) != tuple(self.dest.shape):
            raise ValueError(f"shard shape {list(part.shape)} != parameter shape {list(self.dest.shape)}")
        _copy(self.dest, part)

    def load(self, full: torch.Tensor) -> None:
        self.load_part(full[self.index] if self.index else full)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tp_size ({d})")
    return n // d


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


class SourcedModule(nn.Module):
    def weight_sources(self, leaf: str) -> dict[str, Source]:
        """Checkpoint name (relative to the parent module) -> Source."""
        raise NotImplementedError


# ---------------------------------------------------------------- linears
class MergedColumnParallelLinear(SourcedModule):
    """y = x @ W.T with W's rows split across ranks; W is several checkpoint
    tensors stacked along the output dim (gate|up, or q|k|v). Each source is
    sharded by `shard(i) -> (start, length)` rows of the full tensor."""

    def __init__(self, in_features: int, sizes: list[int], sources: tuple[str, ...] | None,
                 bias: bool = False, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.full_sizes = list(sizes)
        self.sources = sources
        self.local = [self.shard(i)[1] for i in range(len(sizes))]
        self.offsets = [sum(self.local[:i]) for i in range(len(sizes))]
        out = sum(self.local)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def shard(self, i: int) -> tuple[int, int]:
        n = _divide(self.full_sizes[i], self.tp.size, "output features")
        return self.tp.rank * n, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def weight_sources(self, leaf: str) -> dict[str, Source]:
        names = self.sources or (leaf,)
        out = {}
        for i, name in enumerate(names):
            start, n = self.shard(i)
            rows, off = slice(start, start + n), self.offsets[i]
            out[f"{name}.weight"] = Source((self.full_sizes[i], self.in_features),
                                           self.weight.data[off:off + n], (rows,))
            if self.bias is not None:
                out[f"{name}.bias"] = Source((self.full_sizes[i],), self.bias.data[off:off + n], (rows,),
                                             "zeros")
        return out


class ColumnParallelLinear(MergedColumnParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPInfo = TPInfo()):
        super().__init__(in_features, [out_features], None, bias, tp)


class ReplicatedLinear(MergedColumnParallelLinear):
    """Every rank holds the whole weight (e.g. the MoE router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, [out_features], None, bias, TPInfo())


class QKVParallelLinear(MergedColumnParallelLinear):
    """q|k|v with grouped-query attention. Query heads split across ranks; KV
    heads too, or, when there are fewer KV heads than ranks, each rank holds
    a replica of the KV head its query heads read."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 sources: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj"),
                 bias: bool = False, tp: TPInfo = TPInfo()):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_kv_heads")
            self.kv_replicas = 1
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tp_size ({tp.size}) must be a multiple of num_kv_heads "
                                 f"({num_kv_heads}) when it exceeds it")
            self.num_kv_heads = 1
            self.kv_replicas = tp.size // num_kv_heads
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim,
                                  num_kv_heads * head_dim], sources, bias, tp)

    def shard(self, i: int) -> tuple[int, int]:
        d = self.head_dim
        if i == 0:
            return self.tp.rank * self.num_heads * d, self.num_heads * d
        head = self.tp.rank // self.kv_replicas * self.num_kv_heads
        return head * d, self.num_kv_heads * d


class RowParallelLinear(SourcedModule):
    """y = x @ W.T with W's columns (the input dim) split across ranks; the
    partial sums are added by `ops.all_reduce` (a fixed-order reduction)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight)
        if self.tp.size > 1:
            y = ops.all_reduce(y, self.tp.group)
        if self.bias is not None:
            y = y + self.bias
        return y

    def weight_sources(self, leaf: str) -> dict[str, Source]:
        s, n = self.tp.rank * self.local_in, self.local_in
        out = {f"{leaf}.weight": Source((self.out_features, self.in_features), self.weight.data,
                                        (slice(None), slice(s, s + n)))}
        if self.bias is not None:
            out[f"{leaf}.bias"] = Source((self.out_features,), self.bias.data, (), "zeros")
        return out


# ------------------------------------------------------- vocab-parallel
class VocabParallelEmbedding(SourcedModule):
    """Rows of the [vocab, hidden] table split across ranks (vocab padded to a
    multiple of tp_size); a rank looks up the ids it owns, zeros the rest,
    and the ranks' rows are summed (exactly one rank contributes each row)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden = vocab_size, hidden
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        x = ops.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        x = x * mine[:, None].to(x.dtype)
        return ops.all_reduce(x, self.tp.group)

    def weight_sources(self, leaf: str) -> dict[str, Source]:
        n = max(0, min(self.per_rank, self.vocab_size - self.start))  # the last rank's rows are padded
        return {f"{leaf}.weight": Source((self.vocab_size, self.hidden), self.weight.data[:n],
                                         (slice(self.start, self.start + n),))}


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab slice, gathered across ranks in rank order.
    With tied embeddings it shares the embedding's weight and loads nothing."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo = TPInfo(),
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden, tp)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.tied = tied_to is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> logits [R, vocab] float32."""
        logits = ops.linear(hidden, self.weight)  # [R, V/tp]
        if self.tp.size > 1:
            import torch.distributed as dist
            parts = [torch.empty_like(logits) for _ in range(self.tp.size)]
            dist.all_gather(parts, logits.contiguous(), group=self.tp.group)
            logits = torch.cat(parts, dim=-1)  # rank order == vocab order
        return logits[:, :self.vocab_size].float()

    def untie(self) -> None:
        """Its own weight in place of the embedding's (zeros, as an untied head starts)."""
        self.weight = nn.Parameter(torch.zeros_like(self.weight), requires_grad=False)
        self.tied = False

    def weight_sources(self, leaf: str) -> dict[str, Source]:
        return {} if self.tied else super().weight_sources(leaf)


# ------------------------------------------------------------- norm, rope
class RMSNorm(SourcedModule):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)

    def weight_sources(self, leaf: str) -> dict[str, Source]:
        return {f"{leaf}.weight": Source(tuple(self.weight.shape), self.weight.data, (), "ones")}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32, as transformers computes them,
    including linear and Llama 3 ("llama3") frequency scaling."""
    ar = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / (theta ** (ar / head_dim))
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)  # long waves: slowed down
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r}")


def rope_cos_sin(head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:] (ops.rope's layout)."""
    inv = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.arange(max_pos, dtype=torch.int64, device="cpu").float()[:, None] * inv[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin cache. It is a plain attribute, not a buffer, so
    that casting the model to bf16 never rounds it."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None,
                 device: torch.device | str | None = None):
        super().__init__()
        if device is None:
            device = torch.empty(0).device  # honours a surrounding `with torch.device(...)`
        self.cos_sin = rope_cos_sin(head_dim, max_pos, theta, scaling).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.cos_sin.device != q.device:
            self.cos_sin = self.cos_sin.to(q.device)
        return ops.rope(q, k, positions, self.cos_sin)

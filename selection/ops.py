"""The `ops` façade: the only way models/ and engine/ reach kernels.

Each function names its kernel family, the call site's facts (shapes that
do not depend on the batch) and the step's runtime values; the dispatcher
the step context carries (selection/context.py) runs the family's compiled
selector and returns the candidate to call. Selections are memoized per forward step, so a 32-layer model selects
once per family and shape, not once per layer.
"""
from __future__ import annotations

import torch

from detent.selection.context import get_forward_context
from detent.selection.dispatch import get_dispatcher


def _resolve(family: str, site: tuple, num_tokens: int, **extra: int):
    """The candidate (fn, params) the step context's dispatcher selects for this call."""
    d = get_dispatcher()  # raises unless the step context carries one
    return d.resolve(family, site, {**get_forward_context().runtime(num_tokens), **extra})


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias); weight is [N, K] as in torch.nn.Linear."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    n, k = weight.shape
    site = (("n", n), ("k", k), ("dtype", _dt(x)))
    fn, kw = _resolve("gemm", site, x2.shape[0])
    y = fn(x2, weight, bias, **kw)
    return y.reshape(*lead, n)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer_idx: int,
              scale: float) -> torch.Tensor:
    """Write this step's k, v into the paged cache, then attend.

    q: [T, H, D]; k, v: [T, KVH, D]; returns [T, H, D]. Causal within each
    sequence; positions and block tables come from the forward context.
    """
    ctx = get_forward_context()
    if ctx is None or ctx.attn is None:
        raise RuntimeError("ops.attention needs a forward context with attention metadata")
    if ctx.attention_hook is not None:
        return ctx.attention_hook(q, k, v, layer_idx=layer_idx, scale=scale)
    kv_cache = ctx.kv_caches[layer_idx]
    _, h, d = q.shape
    site = (("num_heads", h), ("num_kv_heads", k.shape[1]), ("head_dim", d),
            ("block_size", ctx.attn.block_size), ("dtype", _dt(q)))
    fn, kw = _resolve("attention", site, q.shape[0])
    return fn(q, k, v, kv_cache, ctx.attn, scale, **kw)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm; with `residual`, first x = x + residual and also return the new residual."""
    site = (("hidden", x.shape[-1]), ("dtype", _dt(x)), ("fused_residual", residual is not None))
    fn, kw = _resolve("norm", site, x.shape[0])
    return fn(x, weight, eps, residual, **kw)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
         cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half / NeoX layout). q: [T, H, D], k: [T, KVH, D];
    cos_sin: [max_pos, D] fp32 with cos in [:, :D/2] and sin in [:, D/2:]."""
    site = (("head_dim", q.shape[-1]), ("dtype", _dt(q)))
    fn, kw = _resolve("rope", site, q.shape[0])
    return fn(q, k, positions, cos_sin, **kw)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [M, 2I] laid out [gate | up]; returns silu(gate) * up, [M, I]."""
    site = (("width", x.shape[-1]), ("dtype", _dt(x)))
    fn, kw = _resolve("act", site, x.shape[0])
    return fn(x, **kw)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    site = (("hidden", weight.shape[1]), ("dtype", _dt(weight)))
    fn, kw = _resolve("embedding", site, ids.shape[0])
    return fn(ids, weight, **kw)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax in float32. logits: [R, V]."""
    site = (("vocab", logits.shape[-1]), ("dtype", _dt(logits)))
    fn, kw = _resolve("logsoftmax", site, logits.shape[0])
    return fn(logits, **kw)


def gumbel_argmax(z: torch.Tensor, seeds, positions, sample_indices, role: int,
                  ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the index of max(z + keyed Gumbel noise), first maximum (kernels/gumbel.py).
    z: [B, C] float; ids: [B, C] token ids of z's columns (None: column j is token j)."""
    site = (("dense", ids is None), ("dtype", _dt(z)))
    fn, kw = _resolve("gumbel", site, z.shape[0])
    return fn(z, seeds, positions, sample_indices, role, ids, **kw)


def top_p_keep(xk: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """keep[B, V] bool: top-p's nucleus per row of float32 logits xk [B, V] (-inf: excluded
    already), top_p [B] float64; exact and row by row (kernels/nucleus.py)."""
    site = (("vocab", xk.shape[-1]), ("dtype", _dt(xk)))
    fn, kw = _resolve("top_p", site, xk.shape[0])
    return fn(xk, top_p, **kw)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        top_k: int, renormalize: bool) -> torch.Tensor:
    """Mixture of experts with softmax top-k routing.

    x: [M, H]; router_logits: [M, E]; w13: [E, 2I, H] ([gate | up]);
    w2: [E, H, I]. Returns [M, H]."""
    e, two_i, hdim = w13.shape
    site = (("num_experts", e), ("top_k", top_k), ("hidden", hdim), ("intermediate", two_i // 2),
            ("dtype", _dt(x)))
    fn, kw = _resolve("moe", site, x.shape[0])
    return fn(x, router_logits, w13, w2, top_k, renormalize, **kw)


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum x over the tensor-parallel group; returns the reduced tensor."""
    import torch.distributed as dist
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return x
    site = (("world_size", world), ("dtype", _dt(x)))
    fn, kw = _resolve("allreduce", site, x.shape[0] if x.dim() else 1,
                      message_bytes=x.numel() * x.element_size())
    return fn(x, group, **kw)


def launch_variants(family: str, selection: dict, **step) -> set | None:
    """The compiles a step of this shape needs from `selection`'s candidate beyond what the
    selection fixes (kernels/registry.py `Candidate.variants`); None when the candidate
    decides nothing from the step, or is not registered here."""
    from detent.kernels import registry
    try:
        cand = registry.get(family, selection["impl"])
    except KeyError:
        return None
    return None if cand.variants is None else cand.variants(selection, **step)

"""Gradients through the serving kernels: the trainer is the engine's model
with gradients (docs/rl.md).

`GradDispatcher(inner)` selects exactly as the engine's dispatcher `inner`
does (same provider, same pins, same per-step memo) and hands the `ops`
façade a wrapper of the selected candidate: a `KernelFunction` whose forward
*is* that candidate, so the forward bits are the engine's, and whose
backward differentiates the family's reference math (`grad_refs`)
recomputed from the saved inputs: the matmul families (GEMM, attention, MoE)
in the inputs' own dtype, as transformers' backward runs them (bf16 operands,
float32 accumulation), the rest in float32 (float64 inputs stay float64).
The GEMM's gradients are its two closed-form products (`grad_refs.linear_vjp`),
so its backward does not recompute the forward GEMM.
Gradients are ordinary, not bitwise stable; the forward is bitwise the
engine's. On one H200 the float32 GEMMs had made the trainer's forward +
backward over 2 x 4,096 tokens at Llama-3.1-8B shapes 10x transformers'
(docs/rl.md).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from detent.selection import grad_refs as R


def _compute_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.promote_types(dt, torch.float32)  # bf16/fp16 -> fp32; fp32, fp64 unchanged


def _leaf(t, need: bool, native: bool):
    if t is None or not t.is_floating_point():
        return t
    return t.detach().to(t.dtype if native else _compute_dtype(t.dtype)).requires_grad_(need)


class KernelFunction(torch.autograd.Function):
    """forward: `run(*inputs)` (the selected candidate); backward: autograd of
    `ref(*inputs)`, in the inputs' dtype if `native`, else in float32 or wider,
    or, where the family has one, `vjp(*inputs, *grads, needs=...)`: the same
    gradients in closed form, without recomputing `ref`'s forward.
    `inputs` are tensors or None; static arguments live in the `run` / `ref` closures."""

    @staticmethod
    def forward(ctx, run: Callable, ref: Callable, vjp: Callable | None, native: bool, *inputs):
        ctx.ref, ctx.vjp, ctx.native = ref, vjp, native
        ctx.save_for_backward(*inputs)
        return run(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        if ctx.vjp is not None:
            xs = [_leaf(t, False, ctx.native) for t in inputs]
            got = ctx.vjp(*xs, *(g.to(xs[0].dtype) for g in grads), needs=needs)
            return (None, None, None, None, *(None if g is None else g.to(t.dtype) for t, g in zip(inputs, got)))
        with torch.enable_grad():
            xs = [_leaf(t, n, ctx.native) for t, n in zip(inputs, needs)]
            outs = ctx.ref(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wrt = [x for x, n in zip(xs, needs) if n]
            got = (torch.autograd.grad([o for o, _ in pairs], wrt, [g.to(o.dtype) for o, g in pairs],
                                       allow_unused=True) if pairs and wrt else [None] * len(wrt))
        it = iter(got)
        res = []
        for t, n in zip(inputs, needs):
            g = next(it) if n else None
            res.append(None if g is None else g.to(t.dtype))
        return (None, None, None, None, *res)


def _apply(run, ref, *inputs, native: bool = False, vjp: Callable | None = None):
    return KernelFunction.apply(run, ref, vjp, native, *inputs)


# one wrapper per family: (candidate fn, the ops call's arguments, the selection's params)
def _gemm(fn, x, w, bias, **kw):
    return _apply(lambda x, w, b: fn(x, w, b, **kw), R.linear, x, w, bias, native=True, vjp=R.linear_vjp)


def _attention(fn, q, k, v, kv_cache, meta, scale, history: "StepKV | None" = None, **kw):
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    prior: list[torch.Tensor] = []
    counts: tuple[int, ...] = ()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        before = [lens[b] - (qsl[b + 1] - qsl[b]) for b in range(meta.num_seqs)]
        if any(before):  # chunked: the candidate reads earlier chunks' KV from the cache; the
            if history is None:  # backward needs the tensors that KV came from
                raise ValueError(f"gradients through attention over KV from an earlier step need the "
                                 f"trainer's KV history; sequences {[b for b, n in enumerate(before) if n][:5]} "
                                 f"attend to KV computed in an earlier step")
            ks, vs, counts = history.prior(kv_cache, before)
            prior = ks + vs
        if history is not None:
            history.record(kv_cache, k, v, qsl)
    ref = functools.partial(R.attention, query_start_loc=qsl, scale=scale, prior_counts=counts)
    return _apply(lambda q, k, v, *_: fn(q, k, v, kv_cache, meta, scale, **kw), ref, q, k, v, *prior,
                  native=True)


def _norm(fn, x, w, eps, residual, **kw):
    ref = functools.partial(R.rms_norm, eps=eps)
    return _apply(lambda x, w, r: fn(x, w, eps, r, **kw), ref, x, w, residual)


def _rope(fn, q, k, positions, cos_sin, **kw):
    return _apply(lambda q, k, p, cs: fn(q, k, p, cs, **kw), R.rope, q, k, positions, cos_sin)


def _act(fn, x, **kw):
    return _apply(lambda x: fn(x, **kw), R.silu_and_mul, x)


def _embedding(fn, ids, weight, **kw):
    return _apply(lambda i, w: fn(i, w, **kw), R.embedding, ids, weight)


def _log_softmax(fn, logits, **kw):
    return _apply(lambda x: fn(x, **kw), R.log_softmax, logits)


def _moe(fn, x, router_logits, w13, w2, top_k, renormalize, **kw):
    ref = functools.partial(R.moe, top_k=top_k, renormalize=renormalize)
    return _apply(lambda x, r, a, b: fn(x, r, a, b, top_k, renormalize, **kw), ref, x, router_logits, w13, w2,
                  native=True)


WRAPPERS: dict[str, Callable] = {"gemm": _gemm, "attention": _attention, "norm": _norm, "rope": _rope,
                                 "act": _act, "embedding": _embedding, "logsoftmax": _log_softmax, "moe": _moe}


class KVHistory:
    """The autograd-tracked K and V each sequence wrote into the trainer's
    scratch KV cache, per layer and step. A sequence longer than one step's
    token budget is scored in chunks, as chunked prefill runs a long prompt:
    a later chunk's candidate reads the earlier chunks' KV from the cache
    (so its bits are the engine's), and its backward differentiates into the
    tensors that KV came from, which live here. Only the K and V of
    sequences a later step extends are kept (the size of their KV), until the
    backward."""

    def __init__(self):
        # (layer's KV cache, sequence key) -> {step: (K, V) of that step's chunk}
        self.chunks: dict[tuple[int, Any], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def step(self, step: int, seq_keys: tuple, continues: tuple[bool, ...] | None = None) -> "StepKV":
        """The view one step's attention calls use: `seq_keys[b]` names the step's
        b-th sequence, `continues[b]` says whether a later step extends it (only
        those sequences' K and V are kept; default: all)."""
        return StepKV(self, step, seq_keys, continues or (True,) * len(seq_keys))


class StepKV:
    def __init__(self, history: KVHistory, step: int, seq_keys: tuple, continues: tuple[bool, ...]):
        self.history, self.step_index, self.seq_keys, self.continues = history, step, seq_keys, continues

    def record(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: tuple[int, ...]) -> None:
        for b, key in enumerate(self.seq_keys):
            if not self.continues[b]:
                continue
            chunks = self.history.chunks.setdefault((kv_cache.data_ptr(), key), {})
            # recorded once: a checkpointed layer recomputing in backward keeps the forward's
            # entry, which later steps' graphs already point at. contiguous(): v is a view of
            # the fused qkv projection, which a checkpointed layer would otherwise keep alive
            if self.step_index not in chunks:
                s, e = qsl[b], qsl[b + 1]
                chunks[self.step_index] = (k[s:e].contiguous(), v[s:e].contiguous())

    def prior(self, kv_cache: torch.Tensor, before: list[int]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, ...]]:
        """Each sequence's K and V chunks from earlier steps (the first `before[b]`
        positions of sequence b), and how many chunks each has."""
        ks, vs, counts = [], [], []
        for key, n in zip(self.seq_keys, before):
            chunks = self.history.chunks.get((kv_cache.data_ptr(), key), {})
            parts = [chunks[s] for s in sorted(chunks) if s < self.step_index]
            got = sum(p[0].shape[0] for p in parts)
            if got != n:
                raise ValueError(f"sequence {key!r} attends to {n} earlier KV positions; the trainer's KV "
                                 f"history holds {got}")
            ks += [p[0] for p in parts]
            vs += [p[1] for p in parts]
            counts.append(len(parts))
        return ks, vs, tuple(counts)


class GradDispatcher:
    """The engine's dispatcher, with each selected candidate wrapped in its
    family's `KernelFunction`. A family without a backward (allreduce: the
    trainer runs at tensor_parallel_size 1) raises, naming it. `history`:
    this step's view of the KV history (chunked sequences)."""

    def __init__(self, inner: Any, history: StepKV | None = None):
        self.inner = inner
        self.history = history

    @property
    def mode(self) -> str:
        return self.inner.mode

    def select(self, family: str, site, runtime: dict[str, int]) -> dict:
        return self.inner.select(family, site, runtime)

    def resolve(self, family: str, site, runtime: dict[str, int]) -> tuple[Callable, dict]:
        fn, kw = self.inner.resolve(family, site, runtime)
        wrap = WRAPPERS.get(family)
        if wrap is None:
            raise NotImplementedError(f"kernel family {family!r} has no backward; the trainer supports "
                                      f"{sorted(WRAPPERS)}")
        if family == "attention":
            return functools.partial(wrap, fn, history=self.history), kw
        return functools.partial(wrap, fn), kw

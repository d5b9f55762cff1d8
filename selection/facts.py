"""Deployment facts and their hash (docs/selir.md section 5).

`default_facts_for(config, device, dtype, tp, page_size, max_context)` builds
the facts the engine passes to `make_dispatcher`; `deployment_hash(facts)`
is the hash servers put in responses. Site facts (per call site: GEMM n/k,
attention heads, ...) come from `ops.py` at run time and are merged over
these; `sites_for` lists a model's sites for the default tuple and the CLI.
"""
from __future__ import annotations

import hashlib
from typing import Any

from detent.selection.compiler.jitcache import canonical
from detent.selection.compiler.lang import SELIR_VERSION

ENGINE_VERSION = "0.1.0"
CPU_NUM_SMS = 8  # a notional SM count for FA3's split heuristic on CPU (fixed: facts must not vary by host)

# defaults for deployment facts a caller may leave out
DEFAULTS: dict[str, Any] = {
    "device": "cpu", "arch": "cpu", "num_sms": CPU_NUM_SMS, "dtype": "float32", "tp": 1, "page_size": 16,
    "max_context": 4096, "max_num_batched_tokens": 8192, "max_num_seqs": 256, "triton": False, "fa4": "",
}


def fa4_version() -> str:
    """The installed flash-attn-4's version, "" without it (read from the
    package metadata: nothing is imported). A fact, not a yes/no: FA4's
    selection and bits are those of one version (kernels/attention_fa4.py)."""
    import importlib.metadata
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def default_facts_for(model_config_like: Any, device: str = "cpu", dtype: str = "float32", tp: int = 1,
                      page_size: int = 16, max_context: int = 4096, *, max_num_batched_tokens: int | None = None,
                      max_num_seqs: int = 256, triton: bool | None = None, num_sms: int | None = None,
                      arch: str | None = None, fa4: str | None = None) -> dict[str, Any]:
    """Deployment facts from an HF config dict (or a config object with the same
    attribute names or ModelConfig-style ones: hidden_size/hidden, ...).
    `fa4`: the flash-attn-4 version the deployment runs ("" for none; on CUDA
    the installed one by default, on CPU always "")."""
    c = model_config_like or {}
    hidden = int(_get(c, "hidden_size", "hidden", default=0))
    heads = int(_get(c, "num_attention_heads", "num_heads", default=1))
    kv_heads = int(_get(c, "num_key_value_heads", "num_kv_heads", default=heads))
    head_dim = int(_get(c, "head_dim", default=(hidden // heads if heads else 0)))
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if tp < 1 or (heads % tp) or (kv_heads % tp and tp % kv_heads):
        raise ValueError(f"tp={tp} does not divide the model's {heads} heads / {kv_heads} KV heads")
    if device == "cuda":
        if num_sms is None or arch is None:
            try:
                import torch
                p = torch.cuda.get_device_properties(0)
                num_sms = num_sms or p.multi_processor_count
                arch = arch or f"sm{p.major}{p.minor}"
            except Exception:
                num_sms, arch = num_sms or 132, arch or "sm90"
        if triton is None:
            try:
                import triton as _t  # noqa: F401
                triton = True
            except ImportError:
                triton = False
        if fa4 is None:
            fa4 = fa4_version()
    facts = {
        "device": device, "arch": arch or "cpu", "num_sms": int(num_sms or CPU_NUM_SMS), "dtype": dtype, "tp": tp,
        "page_size": page_size, "max_context": max_context,
        "max_num_batched_tokens": int(max_num_batched_tokens or 8192),  # chunked prefill's token budget
        "max_num_seqs": max_num_seqs, "triton": bool(triton) if device == "cuda" else False,
        "fa4": (fa4 or "") if device == "cuda" else "",
        "hidden": hidden, "num_heads": heads // tp, "num_kv_heads": max(1, kv_heads // tp), "head_dim": head_dim,
        "intermediate": int(_get(c, "intermediate_size", "intermediate", default=0)) // tp,
        "vocab": int(_get(c, "vocab_size", "vocab", default=0)),
        "num_experts": int(_get(c, "num_experts", "num_local_experts", default=0)),
        "top_k": int(_get(c, "num_experts_per_tok", "top_k", default=0)),
        "moe_intermediate": int(_get(c, "moe_intermediate_size", "moe_intermediate", default=0)) // tp,
        "engine_version": ENGINE_VERSION, "selir_version": SELIR_VERSION,
    }
    return facts


def complete(facts: dict[str, Any]) -> dict[str, Any]:
    """Facts with the documented defaults filled in for keys a caller left out
    (on CPU, num_sms <= 0 reads as the notional CPU_NUM_SMS; on CUDA a missing
    `triton` fact is whether triton imports, a missing `fa4` the installed
    flash-attn-4's version)."""
    out = dict(DEFAULTS)
    out.update(facts)
    if out.get("device") == "cpu" and not out.get("num_sms", 0) > 0:
        out["num_sms"] = CPU_NUM_SMS
    if out.get("device") == "cuda" and "triton" not in facts:
        try:  # the Triton candidates run where triton imports
            import triton  # noqa: F401
            out["triton"] = True
        except ImportError:
            out["triton"] = False
    if out.get("device") == "cuda" and "fa4" not in facts:
        out["fa4"] = fa4_version()
    return out


def deployment_hash(facts: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of the deployment facts (hex)."""
    return hashlib.sha256(canonical(facts).encode()).hexdigest()


def site_key(site: dict[str, Any]) -> str:
    """A call site as a stable string: 'k=576,n=1728,dtype=float32' (keys sorted)."""
    return ",".join(f"{k}={site[k]}" for k in sorted(site))


def sites_for(facts: dict[str, Any], family: str) -> list[dict[str, Any]]:
    """The call sites a model of these facts has for a family (per rank), as ops.py builds them."""
    dt = facts.get("dtype", "float32")
    h, nh, kvh, d = facts.get("hidden", 0), facts.get("num_heads", 0), facts.get("num_kv_heads", 0), facts.get("head_dim", 0)
    inter, vocab, tp = facts.get("intermediate", 0), facts.get("vocab", 0), facts.get("tp", 1)
    if family == "gemm":
        if not h:
            return []
        shapes = [((nh + 2 * kvh) * d, h), (h, nh * d), (2 * inter, h), (h, inter)]
        if vocab:
            shapes.append(((vocab + tp - 1) // tp, h))
        out = []
        for n, k in shapes:
            if n and k and {"n": n, "k": k, "dtype": dt} not in out:
                out.append({"n": n, "k": k, "dtype": dt})
        return out
    if family == "attention":
        if not nh:
            return []
        return [{"num_heads": nh, "num_kv_heads": kvh, "head_dim": d, "block_size": facts.get("page_size", 16),
                 "dtype": dt}]
    if family == "moe":
        if not facts.get("num_experts"):
            return []
        return [{"num_experts": facts["num_experts"], "top_k": facts["top_k"], "hidden": h,
                 "intermediate": facts.get("moe_intermediate", 0), "dtype": dt}]
    if family == "allreduce":
        return [{"world_size": tp, "dtype": dt}] if tp > 1 else []
    return [{"dtype": dt}]

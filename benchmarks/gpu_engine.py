"""Shared setup of the GPU benchmarks (decode.py, prefill.py): one engine
with dummy weights at a preset's real shapes, and a switch between the
selection modes that keeps the weights and the KV pool (three modes in one
run, on the same memory)."""
from __future__ import annotations

import time

import torch

from detent.engine.llm import LLM
from detent.models.config import ModelConfig
from detent.models.loader import load_model
from detent.models.presets import preset

COPY_BW = 4.23e12  # measured on the H200 (docs/performance.md); main() re-measures it


def measure_copy_bw() -> float:
    import triton
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median")
    del a, b
    return 2 * 2 ** 30 / (ms * 1e-3)


def build(model_name: str, *, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int = 8192,
          gpu_memory_utilization: float = 0.9, seed: int = 0, enable_prefix_caching: bool = False,
          hf_config: dict | None = None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
          max_mixed_batched_tokens: int | None = 2048, block_size: int = 16):
    """Dummy weights (models/weights.init_dummy: norms 1, biases 0, matrices
    N(0, 0.02)) at the preset's shapes. `hf_config` replaces the preset's
    config (tiny models for CPU runs of the harnesses); `device="cpu"` runs
    without CUDA (tests)."""
    if hf_config is None:
        cfg = preset(model_name)
        if cfg is None:
            raise ValueError(f"unknown preset {model_name!r}")
        hf_config = cfg["config"]
    mc = ModelConfig.from_hf(hf_config)
    cuda = torch.device(device).type == "cuda"
    t0 = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = load_model(mc, device=device, dtype=dtype, load_format="dummy", seed=seed, progress=False)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.time() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    llm = LLM.from_model(model, mc, selection="pinned", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                         max_mixed_batched_tokens=max_mixed_batched_tokens, block_size=block_size,
                         gpu_memory_utilization=gpu_memory_utilization, enforce_eager=True, device=device)
    eng = llm.llm_engine
    kv_bytes = sum(t.numel() * t.element_size() for t in eng.runner.kv_caches)
    info = {"model": model_name, "weight_bytes": weight_bytes, "load_s": load_s,
            "kv_pool_tokens": eng.limits().kv_cache_tokens, "kv_pool_bytes": kv_bytes,
            "block_size": eng.state.block_size,
            "kv_bytes_per_token": kv_bytes // (eng.state.num_blocks * eng.state.block_size),
            "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
            "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len}
    return llm, mc, info


def dispatcher_for(eng, mode: str, knobs: dict[str, dict] | None = None):
    """The project's dispatcher for `mode` (SelIR, selection/programs); with
    `knobs` ({family: {knob: value}}, mode pinned) through the default tuple
    with those knobs set (e.g. {"attention": {"impl": "fa4"}}). Returns
    (d, source); refuses to time another attention than the tuple's on CUDA."""
    import tempfile

    from detent.selection import default_tuple, make_dispatcher
    f = eng.facts
    tuple_path = None
    if knobs:
        if mode != "pinned":
            raise ValueError(f"tuple knobs {knobs} apply in mode pinned, not {mode!r}")
        tuple_path = tempfile.mkstemp(suffix=".json", prefix="detent-tuple-")[1]
        default_tuple(f, knobs=knobs).save(tuple_path)
    d = make_dispatcher(f, mode, tuple_path)
    site = (("num_heads", f["num_heads"]), ("num_kv_heads", f["num_kv_heads"]), ("head_dim", f["head_dim"]),
            ("block_size", f["page_size"]), ("dtype", f["dtype"]))
    sel = d.select("attention", site, dict(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=1, total_kv=1))
    want = (knobs or {}).get("attention", {}).get("impl", "triton_paged")
    if f["device"] == "cuda" and sel["impl"] != want:
        raise RuntimeError(f"SelIR selected {sel} for attention on CUDA, not {want}: is triton importable? facts={f}")
    return d, "selection (SelIR)" + (f", tuple {tuple_path}" if tuple_path else "")


def _value(v: str):
    """A mode suffix's value: an int, true / false as a bool (knobs such as
    attention.overlap_short), else the string."""
    if v.lstrip("-").isdigit():
        return int(v)
    return {"true": True, "false": False}.get(v.lower(), v)


def set_mode(llm, mode: str, *, graphs: bool | str, capture_sizes: list[int] | None = None) -> dict:
    """mode: "stock" | "pinned" | "conservative", optionally with environment
    settings read by the kernels ("pinned+VAR=VAL"), candidate parameters
    added to one family's selection ("pinned+moe:fuse_glue=1",
    `selection.provider.FamilyOverride`) and tuple knobs
    ("pinned+attention.impl=fa4": FlashAttention-4 for every step) and engine config
    fields the graphs read ("pinned+config:piecewise_max_tokens=2048": steps of more
    tokens run eagerly).
    graphs: False (every step eager), True or "decode" (decode graphs; steps with
    prompt rows eager: the harnesses' numbers up to lease 21), "serving" (the
    graphs `detent-serve` runs: decode, piecewise and whole-step graphs,
    engine/graphs.py, as vLLM's side runs its own defaults)."""
    import os

    from detent.engine.cuda_graph import enable_cuda_graphs
    from detent.selection.dispatch import Dispatcher
    from detent.selection.provider import FamilyOverride
    eng = llm.llm_engine
    base, *extras = mode.split("+")
    params: dict[str, dict] = {}
    knobs: dict[str, dict] = {}
    for kv in extras:
        k, _, v = kv.partition("=")
        if "." in k:
            fam, _, name = k.partition(".")
            knobs.setdefault(fam, {})[name] = _value(v)
        elif ":" in k:
            fam, _, name = k.partition(":")
            params.setdefault(fam, {})[name] = _value(v)
        else:
            os.environ[k] = v
    config = params.pop("config", {})
    d, source = dispatcher_for(eng, base, knobs)
    for fam, extra in params.items():
        d = Dispatcher(FamilyOverride(d.provider, fam, extra=extra))
    eng.dispatcher = d
    eng.runner.dispatcher = d
    out = {"mode": mode, "selection_source": source, "overrides": params, "knobs": knobs, "config": config,
           "env": {k: v for k, v in os.environ.items() if k.startswith("DETENT_")}}
    if graphs == "serving":
        import dataclasses

        from detent.engine.graphs import GRAPH_ATTRS, enable_graphs
        t0 = time.time()  # the engine was built eager (build): its config asks for the graphs
        enable_graphs(eng.runner, dataclasses.replace(eng.config, enforce_eager=False, **config),
                      max_model_len=eng.state.max_model_len)
        out["graph_capture_s"] = time.time() - t0
        out["graphs"] = {name: (g.disabled or "captured") for name in GRAPH_ATTRS
                         if (g := getattr(eng.runner, name, None)) is not None}
    elif graphs:
        t0 = time.time()
        g = enable_cuda_graphs(eng.runner, max_num_seqs=eng.config.max_num_seqs,
                               max_model_len=eng.state.max_model_len, capture_sizes=capture_sizes)
        out["graph_capture_s"] = time.time() - t0
        out["cuda_graphs"] = g.disabled or f"captured {sorted(g.graphs)}"
    elif getattr(eng.runner, "_eager_forward", None) is not None:
        eng.runner._forward = eng.runner._eager_forward
    return out

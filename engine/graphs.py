"""The CUDA graphs a GPU runner replays, installed in one place (startup and the tuner)."""
from __future__ import annotations

import gc
import logging

import torch

from detent.engine.config import MIXED_GRAPH_MIN_TOKENS
from detent.engine.cuda_graph import enable_cuda_graphs

log = logging.getLogger(__name__)


def enable_graphs(runner, config, *, max_model_len: int) -> None:
    """The graphs a GPU runner replays (`config.enforce_eager` turns them off):
    decode graphs, and at tp = 1 piecewise graphs for steps with prefill tokens
    (engine/piecewise_graph.py; under tensor parallelism those stay eager) and,
    where `config.mixed_graph_max_tokens` asks for them, whole-step graphs for
    small such steps in front of those (engine/mixed_graph.py). Their captures' compiles are a
    startup's, not serving's (compile_watch.paused), wherever this runs (startup, the tuner)."""
    if runner.device.type != "cuda" or config.enforce_eager:
        return
    release_graphs(runner)
    from detent.engine.compile_watch import paused
    with paused():
        _enable(runner, config, max_model_len)


GRAPH_ATTRS = ("cuda_graphs", "piecewise_graphs", "mixed_graphs")


def graph_failures(runner) -> dict[str, str]:
    """The graph sets the runner tried to capture and could not, with why (their `disabled`)."""
    return {name: g.disabled for name in GRAPH_ATTRS
            if (g := getattr(runner, name, None)) is not None and g.disabled}


def release_graphs(runner) -> None:
    """Drop the graphs a runner holds, and their memory pools, before it captures again.

    The tuner recaptures for every tuple it measures (detent/tune_engine.py). Holding the
    old graphs through the new captures needs two sets of graph memory beside a KV cache
    sized for one: on the H200 (Llama-3.1-8B shapes) the captures ran out of memory and
    fell back to eager steps, which the tuner then timed (docs/performance.md, "Lease 15").
    A runner that never captured is left as it is."""
    eager = getattr(runner, "_eager_forward", None)
    if eager is not None:
        runner._forward = eager  # the replaying closures hold the graphs: drop them first
    held = [name for name in GRAPH_ATTRS if getattr(runner, name, None) is not None]
    for name in held:
        setattr(runner, name, None)
    if held:
        gc.collect()
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()


def _enable(runner, config, max_model_len: int) -> None:
    # a decode-only step has one token per sequence, so it never has more rows than the step
    # budget: graphs past it would fail the capture (the GEMM program's domain) and turn every
    # decode graph off (a battery engine: 64 sequences, 32-token budget)
    enable_cuda_graphs(runner, max_num_seqs=min(config.max_num_seqs, config.max_num_batched_tokens),
                       max_model_len=max_model_len)
    limit = min(config.piecewise_max_tokens, config.max_num_batched_tokens)
    if config.tensor_parallel_size == 1 and limit >= 16:
        from detent.engine.piecewise_graph import enable_piecewise_graphs
        enable_piecewise_graphs(runner, max_tokens=limit)
    if config.tensor_parallel_size == 1 and config.mixed_graph_max_tokens >= MIXED_GRAPH_MIN_TOKENS:
        sites = [site for fam, site in runner.dispatcher.built() if fam == "attention"]
        if len(sites) != 1:  # the captures above ran every layer: one attention shape is ours
            log.warning("mixed-step graphs off: %d attention call sites, expected 1", len(sites))
            return
        from detent.engine.mixed_graph import enable_mixed_graphs, refusal
        why = refusal(runner.dispatcher.built()[("attention", sites[0])])
        if why:
            log.info("mixed-step graphs off (those steps replay the piecewise graphs): %s", why)
            return
        enable_mixed_graphs(runner, max_tokens=config.mixed_graph_max_tokens, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                            attention_site=sites[0])

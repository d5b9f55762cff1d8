"""One startup recipe for every rank: model in, runner out.

`build_runner` turns a loaded model (the whole model at tp = 1, one shard on
a tensor-parallel rank) into what a step needs: the KV cache sized from one
formula, the engine state, the deployment facts, the dispatcher and the
`ModelRunner` (with CUDA graphs on GPU). `LLMEngine` calls it for tp = 1,
`engine/tp/worker.py` on every rank, so both paths size, select and run
alike; ranks only add that they agree on the smallest block count.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from detent.engine.config import EngineConfig, EngineState
from detent.engine.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for
from detent.engine.model_runner import ModelRunner
from detent.selection.facts import default_facts_for

log = logging.getLogger("detent.engine.startup")


def max_model_len_for(config: EngineConfig, mc: Any) -> int:
    """`config.max_model_len`, or the model's `max_position_embeddings`; never above it."""
    max_len = config.max_model_len or mc.max_position_embeddings
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                         f"{mc.max_position_embeddings}")
    return max_len


# deployment fact -> (detent-serve flag, LLM argument) that sets it
FACT_OPTIONS = {"max_context": ("--max-model-len", "max_model_len"), "max_num_seqs": ("--max-num-seqs", "max_num_seqs"),
                "max_num_batched_tokens": ("--max-num-batched-tokens", "max_num_batched_tokens"),
                "tp": ("--tp", "tensor_parallel_size"), "dtype": ("--dtype", "dtype"),
                "page_size": ("--block-size", "block_size")}


def tuple_command(config: EngineConfig, facts: dict[str, Any]) -> str:
    """The `detent tuple default` line that writes a tuple for exactly these facts."""
    import shlex
    return (f"detent tuple default --model {shlex.quote(config.model or 'embedded')} --device {facts['device']} "
            f"--dtype {facts['dtype']} --tp {facts['tp']} --page-size {facts['page_size']} "
            f"--max-model-len {facts['max_context']} --max-num-batched-tokens {facts['max_num_batched_tokens']} "
            f"--max-num-seqs {facts['max_num_seqs']} -o t.json")


def matching_tuple_hint(config: EngineConfig, facts: dict[str, Any], err: Any) -> str:
    """What to do when the tuple was made for another deployment: make one for this one,
    or (when a flag sets the fact) run with the tuple's value."""
    lines = [f"Make a tuple for this deployment:\n    {tuple_command(config, facts)}"]
    flag, arg = FACT_OPTIONS.get(err.fact, (None, None))
    if arg is not None:
        made_for = err.made_for
        how = f"{flag} {made_for} (LLM(..., {arg}={made_for!r}))" if flag else f"LLM(..., {arg}={made_for!r})"
        lines.append(f"or run with the tuple's value: {how}.")
    return "\n".join(lines)


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds (1 when KV heads are replicated)."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1


def activation_reserve_bytes(config: EngineConfig, mc: Any, world: int) -> int:
    """Device memory kept out of the KV pool for one step's activations, roughly
    (fp32 words per token: the residual stream and a rank's share of the MLP)."""
    return config.max_num_batched_tokens * (6 * mc.hidden_size + 3 * mc.intermediate_size // world) * 4


def deployment_facts(config: EngineConfig, mc: Any, state: EngineState) -> dict[str, Any]:
    """The deployment facts SelIR partially evaluates against (docs/selir.md).

    One recipe for the engine and for `detent tuple default --model ...`
    (`selection.facts.default_facts_for`), so a tuple made offline matches
    the engine that loads it. Head counts and widths are per rank."""
    return default_facts_for(
        mc, device=state.device.type, dtype=str(state.dtype).removeprefix("torch."),
        tp=config.tensor_parallel_size, page_size=state.block_size, max_context=state.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs)


def freeze_gc_heap(config: EngineConfig, device: torch.device) -> bool:
    """Once startup is done (weights, KV pool, CUDA graphs): collect, then
    freeze what is left out of every later collection (`EngineConfig.freeze_gc`).

    A full (generation 2) collection walks every tracked object: ~250k after
    torch, triton and transformers are imported, 0.11-0.15 s. Python runs one
    whenever enough new objects survived younger collections, and in the
    engine loop that is a step the device waits for (benchmarks/step_trace.py
    measured one 118 ms idle gap among 120 steps of 7.6 ms at batch 64).
    Objects made later (requests, outputs) stay collectable."""
    if not (device.type == "cuda" if config.freeze_gc is None else config.freeze_gc):
        return False
    gc.collect()
    gc.freeze()
    return True


@dataclass(frozen=True)
class RankRuntime:
    """What startup built for one rank."""
    runner: ModelRunner
    state: EngineState
    facts: dict[str, Any]
    dispatcher: Any  # selection.dispatch.Dispatcher


def build_runner(config: EngineConfig, model: torch.nn.Module, mc: Any, device: torch.device, *,
                 world: int = 1, group=None, dispatcher=None) -> RankRuntime:
    """Size and allocate the KV cache, make the dispatcher (unless given) and
    the runner for `model` on `device`; `world > 1`: one rank of a group."""
    from detent.selection import FactMismatch, make_dispatcher

    dtype = next(model.parameters()).dtype
    max_len = max_model_len_for(config, mc)
    spec = KVCacheSpec(mc.num_layers, local_kv_heads(mc.num_kv_heads, world), mc.head_dim, dtype,
                       config.block_size)
    num_blocks = num_blocks_for(spec, device, max_model_len=max_len, max_num_seqs=config.max_num_seqs,
                                kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                                num_gpu_blocks=config.num_gpu_blocks,
                                gpu_memory_utilization=config.gpu_memory_utilization,
                                activation_reserve_bytes=activation_reserve_bytes(config, mc, world))
    if world > 1:  # one block table serves every rank: agree on the smallest pool
        import torch.distributed as dist
        t = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        num_blocks = int(t.item())
    state = EngineState(device, dtype, max_len, num_blocks, config.block_size)
    facts = deployment_facts(config, mc, state)
    if config.attention_backend is not None and not (facts.get("device") == "cuda" and facts.get("triton")):
        raise ValueError(f"attention_backend={config.attention_backend!r}: a choice of CUDA deployments (with "
                         f"Triton); this one runs on {facts.get('device')}, where attention has one "
                         f"implementation: leave attention_backend unset")
    if dispatcher is None:
        try:
            dispatcher = make_dispatcher(facts, config.selection, config.tuple, config.tuple_knobs())
        except FactMismatch as e:
            raise FactMismatch(f"{e}\n{matching_tuple_hint(config, facts, e)}", e.fact, e.made_for, e.here) from None
    runner = ModelRunner(model, allocate_kv_caches(spec, num_blocks, device), config.block_size,
                         dispatcher, device)
    from detent.engine.graphs import enable_graphs
    enable_graphs(runner, config, max_model_len=max_len)  # both pause the compile watch:
    warm_start(runner, config, facts, max_len, world=world, group=group)  # a startup is not serving
    return RankRuntime(runner, state, facts, dispatcher)


def warm_start(runner, config: EngineConfig, facts: dict, max_len: int, *, world: int = 1, group=None,
               progress: bool = True) -> None:
    """Run every kernel configuration the runner's dispatcher can select (engine/warmup.py), where
    `config.warmup` asks for it (default: on CUDA). Also after a tool installs another tuple."""
    if not (runner.device.type == "cuda" if config.warmup is None else config.warmup):
        return
    from detent.engine.warmup import Limits, warm_up
    rank0 = world == 1 or torch.distributed.get_rank(group) == 0
    lim = Limits(config.max_num_batched_tokens, config.max_num_seqs, max_len)
    from detent.engine.compile_watch import paused
    try:
        with paused():
            warm_up(runner, facts, lim, progress=progress and rank0)
    except Exception as e:  # noqa: BLE001  (as a failed graph capture: serve, compile on demand, say why)
        if world > 1:
            raise  # the ranks must not disagree on what ran
        log.warning("warm start failed (%s: %s); kernels compile at first use", type(e).__name__, e)
        return
    from detent.engine.compile_watch import watch_compiles
    runner.compile_watch = watch_compiles()  # from here on, a compile is named in the log

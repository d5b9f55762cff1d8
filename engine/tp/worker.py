"""One tensor-parallel rank: a spawned process that loads its shard of the
model, sizes its KV cache, and runs the same `ModelRunner` as tp = 1 on
every plan the driver sends.

Protocol over the rank's pipe (pickled tuples):
  driver -> rank: ("execute", SchedulerOutput, params, drop) | ("launch", SchedulerOutput, params, drop)
                  | ("collect",) | ("call", fn, args) | ("shutdown",)
  rank -> driver: ("ready", RankInfo) | ("result", ModelOutput | None, digest) | ("error", traceback)
"launch" (async scheduling) queues the plan on the device and answers with
the result of the previously launched plan, if any; "collect" answers with
the last launched plan's result. A plan's rows name their request's sampling
parameters, which the rank keeps from the plan that first sent them (`params`)
until the driver drops them (`drop`; engine/tp/plan.py).
Rank 0 sends its ModelOutput; every rank sends a digest of its own, so the
driver can check that all ranks agree without shipping N copies.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from detent.engine.startup import build_runner, freeze_gc_heap
from detent.engine.tp.plan import KeptParams

# NVLink multicast (NVLS) reduces inside the switch in an order we do not control
FORCED_ENV = {"NCCL_NVLS_ENABLE": "0"}


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    device: str
    dtype: str
    num_blocks: int
    max_model_len: int
    facts: dict[str, Any]


@dataclass
class RankState:
    runner: Any  # ModelRunner
    info: RankInfo
    params: KeptParams = field(default_factory=KeptParams)  # the sampling parameters the driver sent


def rank_device(config, rank: int) -> torch.device:
    dev = config.resolve_device()
    if dev.type == "cuda":
        return torch.device("cuda", rank)  # one GPU per rank, in CUDA_VISIBLE_DEVICES order
    return dev


def build_rank(config, resolved, rank: int, world: int, device: torch.device, group=None,
               dispatcher=None) -> RankState:
    """Load this rank's shard and build its runner with the recipe tp = 1 uses
    (engine/startup.py), with per-rank KV heads and an agreed block count."""
    from detent.models.loader import load_model

    mc = resolved.config
    dtype = config.resolve_dtype(mc, device)
    model = load_model(mc, device=device, dtype=dtype, load_format=resolved.load_format, path=resolved.path,
                       tp_rank=rank, tp_size=world, tp_group=group, seed=config.seed,
                       progress=rank == 0)
    rt = build_runner(config, model, mc, device, world=world, group=group, dispatcher=dispatcher)
    info = RankInfo(rank, os.getpid(), str(device), str(dtype).removeprefix("torch."), rt.state.num_blocks,
                    rt.state.max_model_len, rt.facts)
    return RankState(rt.runner, info)


def digest(obj: Any) -> str:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).hexdigest()


def _send(conn, msg: tuple) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver is gone (no orphans, even if it was SIGKILLed
    while this rank waits inside a collective)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _init_distributed(rank: int, world: int, init_method: str, device: torch.device,
                      timeout_s: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), device_id=device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))


def worker_main(rank: int, world: int, init_method: str, config, resolved, conn, parent_pid: int,
                cpu_threads: int, timeout_s: float) -> None:
    os.environ.update(FORCED_ENV)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="tp-parent-watch").start()
    try:
        device = rank_device(config, rank)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads)
        _init_distributed(rank, world, init_method, device, timeout_s)
        st = build_rank(config, resolved, rank, world, device)
        freeze_gc_heap(config, device)
        _send(conn, ("ready", st.info))
        prev = None  # the launched step whose result the driver has not asked for yet

        def result(out) -> None:
            _send(conn, ("result", out if rank == 0 else None, digest(out)))
        while True:
            msg = pickle.loads(conn.recv_bytes())
            kind = msg[0]
            if kind == "execute":
                result(st.runner.execute(st.params.plan(*msg[1:])))
            elif kind == "launch":  # async scheduling: launch, then hand over the step before
                handle = st.runner.launch(st.params.plan(*msg[1:]), prev)
                if prev is not None:
                    result(st.runner.collect(prev))
                prev = handle
            elif kind == "collect":
                out, prev = st.runner.collect(prev), None
                result(out)
            elif kind == "call":  # collective_rpc: fn(RankState, *args) on every rank
                fn, args = msg[1], msg[2]
                _send(conn, ("result", fn(st, *args), ""))
            elif kind == "shutdown":
                break
            else:
                raise ValueError(f"tensor-parallel worker: unknown message {kind!r}")
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(4)  # the driver went away: nothing to report to
    except BaseException:  # noqa: BLE001 - the driver raises it with this traceback
        try:
            _send(conn, ("error", f"rank {rank} (pid {os.getpid()}):\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)  # other ranks may be stuck in a collective: the driver terminates them
    # exit without destroy_process_group: its teardown can wait on peers
    # that are exiting too, and the process is going away anyway
    conn.close()
    os._exit(0)

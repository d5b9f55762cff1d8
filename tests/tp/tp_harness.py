"""Run a function on N gloo ranks (spawned processes) and collect each rank's result.

Spawning costs a few seconds per process on the 2-core CI machine (each
child imports torch), so a test module runs all its rank-side checks in one
spawn and asserts on the collected results.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    # torch.save, not the queue's pickler: that one shares tensor storage by
    # file descriptor, which dies with the child process
    import io

    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _child(fn, rank: int, world: int, port: int, args: tuple, q, backend: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        kw = {}
        if backend == "nccl":
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (its reduction order is the switch's)
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60), **kw)
        try:
            q.put((rank, "ok", _dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report to the parent, which raises
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list:
    """fn(rank, world, *args) on `world` ranks (gloo on CPU; "nccl": one GPU
    per rank); returns the results by rank.

    fn must be importable (module level) and return something picklable."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, q, backend), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, value = q.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(results))
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited (code {procs[dead[0]].exitcode}) "
                                       "without reporting") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {missing} did not report within {timeout}s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = _loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [results[r] for r in range(world)]

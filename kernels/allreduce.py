"""All-reduce candidates: sum a tensor over the tensor-parallel group.

Call signature (after dispatch): ``fn(x, group, **params) -> tensor`` with
the shape and dtype of ``x``. ``x`` may be overwritten (as vLLM's and NCCL's
in-place all-reduce do); use the returned tensor.

Why the family exists: the stock library all-reduce picks its algorithm
(ring, tree, one-shot, two-shot, chunking) from the message size, and the
algorithm decides in which order each element's N partial sums are added.
A token's hidden state is one row of the message, so its bits depend on how
many other tokens share the step. gloo does this on CPU (a row reduced alone
differs from the same row inside a 2-row message; tests/tp) and NCCL does it
on GPU.

- ``native``: ``dist.all_reduce`` (NCCL or gloo): the stock choice.
- ``ordered_gather``: all-gather the N partials (pure data movement), then
  add them in rank order 0..N-1 in float32 and cast once. Each element's sum
  is ``((p0 + p1) + p2) + ...`` whatever the message size, on every rank, on
  CPU and GPU.
- ``one_shot`` / ``two_shot`` (CUDA): torch symmetric memory
  (``torch.ops.symm_mem``) over peer buffers. Both kernels load the N peers'
  values and add them in rank order 0..N-1 in the input dtype (bf16 adds
  for bf16), so they agree with each other bit for bit for any message size,
  but for bf16 and N > 2 not with ``ordered_gather`` (fp32 accumulation).
  Never the NVLink multicast (``multimem_*``) variants, whose in-switch
  reduction order is the hardware's.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from detent.kernels.registry import register

_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@register("allreduce", "native")
def all_reduce_native(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


@register("allreduce", "ordered_gather")
def all_reduce_ordered_gather(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    flat = x.contiguous().view(-1)  # [n]
    parts = flat.new_empty(world * flat.numel())
    _gather_single(parts, flat, group=group)
    parts = parts.view(world, -1)  # [N, n]: row r is rank r's partial
    acc = parts[0].to(torch.float32, copy=True)
    for r in range(1, world):  # fixed rank order, fp32 accumulator
        acc.add_(parts[r])
    return acc.to(x.dtype).view(x.shape)


# ---------------------------------------------------------------- CUDA: symmetric memory

_SYMM_DTYPES = (torch.float32, torch.bfloat16)  # what torch.ops.symm_mem's kernels dispatch on
_MAX_WORKSPACE = int(os.environ.get("DETENT_SYMM_MEM_MAX_BYTES", str(512 << 20)))


class _Workspace:
    """One symmetric buffer per (group, device), grown on demand.

    Growing is a collective (rendezvous), which is safe because every rank
    of the group makes the same all-reduce call with the same shape. It is
    not allowed during CUDA-graph capture: call `reserve` before capturing.
    """

    def __init__(self):
        self.buf: torch.Tensor | None = None  # uint8 [nbytes], symmetric
        self.handle = None
        self.retired: list = []  # outgrown buffers stay allocated (peers' kernels may still read them)

    def view(self, nbytes: int, dtype: torch.dtype, group) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.reserve(nbytes, group)
        return self.buf[:nbytes].view(dtype)

    def reserve(self, nbytes: int, group) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        if nbytes > _MAX_WORKSPACE:
            raise RuntimeError(
                f"allreduce one_shot/two_shot: message of {nbytes} bytes exceeds the symmetric-memory "
                f"workspace limit DETENT_SYMM_MEM_MAX_BYTES={_MAX_WORKSPACE}; the allreduce selector must "
                "not pick a peer-buffer candidate for this size (or raise the limit)")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"allreduce one_shot/two_shot: the workspace must grow to {nbytes} bytes during CUDA-graph "
                "capture; reserve it before capture (kernels.allreduce.reserve_workspace)")
        size = 1 << max(20, (nbytes - 1).bit_length())  # >= 1 MiB, power of two
        size = min(size, max(_MAX_WORKSPACE, nbytes))
        buf = symm_mem.empty(size, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        handle = symm_mem.rendezvous(buf, _group_name(group))
        if self.buf is not None:
            self.retired.append((self.buf, self.handle))
        self.buf, self.handle = buf, handle


_WORKSPACES: dict[tuple[str, int], _Workspace] = {}


def _group_name(group) -> str:
    g = group if group is not None else dist.group.WORLD
    return g.group_name


def _workspace(group) -> _Workspace:
    key = (_group_name(group), torch.cuda.current_device())
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _Workspace()
    return ws


def reserve_workspace(nbytes: int, group=None) -> None:
    """Collective: make the peer-buffer workspace at least `nbytes` (before graph capture)."""
    ws = _workspace(group)
    if ws.buf is None or ws.buf.numel() < nbytes:
        ws.reserve(nbytes, group)


def _symm_prepare(x: torch.Tensor, group, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    if x.device.type != "cuda":
        raise RuntimeError(f"allreduce {name} runs on CUDA tensors only, got a {x.device.type} tensor")
    if x.dtype not in _SYMM_DTYPES:
        raise RuntimeError(f"allreduce {name}: torch.ops.symm_mem supports float32 and bfloat16, got {x.dtype}")
    flat = x.contiguous().view(-1)
    n = flat.numel()
    npad = -n % (16 // x.element_size())  # keep the kernels' 16-byte vector path: pad the tail
    if npad:
        flat = torch.cat([flat, flat.new_zeros(npad)])
    elif flat.storage_offset() * flat.element_size() % 16:
        flat = flat.clone()  # the kernels need the local input 16-byte aligned, like the buffer
    buf = _workspace(group).view(flat.numel() * flat.element_size(), x.dtype, group)
    return flat, buf, n


@register("allreduce", "one_shot", devices=("cuda",))
def all_reduce_one_shot(x: torch.Tensor, group) -> torch.Tensor:
    flat, buf, n = _symm_prepare(x, group, "one_shot")
    # copies the local partial into this rank's peer buffer, then every rank
    # reads all N buffers and adds them in rank order 0..N-1
    out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf, flat, "sum", _group_name(group))
    return out[:n].view(x.shape)


@register("allreduce", "two_shot", devices=("cuda",))
def all_reduce_two_shot(x: torch.Tensor, group) -> torch.Tensor:
    flat, buf, n = _symm_prepare(x, group, "two_shot")
    buf.copy_(flat)
    # reduce-scatter (rank r sums its 1/N slice in rank order 0..N-1), then all-gather
    out = torch.empty_like(flat)
    torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", _group_name(group), out)
    return out[:n].view(x.shape)

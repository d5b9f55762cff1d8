"""Run one sequence's prefill through a Detent model with a fresh paged KV
cache (layout of selection/context.py and the attention candidates:
per layer [2, num_blocks, block_size, KVH, D], slot = block * bs + offset)."""
from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from detent.selection.context import AttentionMetadata, ForwardContext, forward_context
from detent.selection import make_dispatcher

BLOCK = 16


def cpu_dispatcher(mode: str = "pinned"):
    return make_dispatcher({"device": "cpu"}, mode)


def _meta(start: int, n: int, seq_len: int, num_blocks: int, device) -> AttentionMetadata:
    blocks = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]  # seq owns blocks 0..
    pos = torch.arange(start, start + n, device=device)
    slots = (blocks[0].long()[pos // BLOCK] * BLOCK + pos % BLOCK)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_tables=blocks, slot_mapping=slots, num_seqs=1, num_tokens=n,
        max_seqlen_q=n, max_seqlen_k=seq_len, block_size=BLOCK,
        query_start_loc_cpu=(0, n), seq_lens_cpu=(seq_len,))


class Session:
    """One sequence: prefill, then decode steps, each a real paged-KV step."""

    def __init__(self, model, max_len: int = 256, mode: str = "pinned"):
        cfg = model.config
        p = next(model.parameters())
        self.model, self.device = model, p.device
        nb = -(-max_len // BLOCK)
        self.kv = [torch.zeros(model.kv_cache_shape(nb, BLOCK), dtype=p.dtype, device=p.device)
                   for _ in range(cfg.num_layers)]
        self.num_blocks, self.len, self.mode = nb, 0, mode

    @torch.no_grad()
    def step(self, ids: list[int]) -> torch.Tensor:
        """Feed `ids` (after what came before); returns their logits [n, V] fp32."""
        n = len(ids)
        meta = _meta(self.len, n, self.len + n, self.num_blocks, self.device)
        ctx = ForwardContext(attn=meta, kv_caches=self.kv, dispatcher=cpu_dispatcher(self.mode))
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.arange(self.len, self.len + n, device=self.device)
        with forward_context(ctx):
            hidden = self.model(ids_t, pos)
            logits = self.model.compute_logits(hidden)
        self.len += n
        return logits


def prefill_logits(model, ids: list[int], mode: str = "pinned") -> torch.Tensor:
    return Session(model, max_len=len(ids) + BLOCK, mode=mode).step(ids)


def greedy(model, prompt: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
    s = Session(model, max_len=len(prompt) + n + BLOCK)
    logits = s.step(prompt)
    out = []
    for _ in range(n):
        tok = int(torch.argmax(logits[-1]))
        out.append(tok)
        if tok in stop:
            break
        logits = s.step([tok])
    return out


@torch.no_grad()
def batch_prefill_logits(model, seqs: list[list[int]], mode: str = "pinned") -> list[torch.Tensor]:
    """Prefill several sequences in ONE forward step (back to back in the
    token dimension, each in its own KV blocks); each sequence's logits."""
    cfg, p = model.config, next(model.parameters())
    per = [-(-len(s) // BLOCK) for s in seqs]
    nb = sum(per)
    kv = [torch.zeros(model.kv_cache_shape(nb, BLOCK), dtype=p.dtype) for _ in range(cfg.num_layers)]
    width = max(per)
    tables, slots, first = [], [], 0
    for s, n in zip(seqs, per):
        blocks = list(range(first, first + n))
        tables.append(blocks + [0] * (width - n))
        slots += [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(s))]
        first += n
    qsl = [0]
    for s in seqs:
        qsl.append(qsl[-1] + len(s))
    lens = tuple(len(s) for s in seqs)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=torch.tensor(slots),
        num_seqs=len(seqs), num_tokens=qsl[-1], max_seqlen_q=max(lens), max_seqlen_k=max(lens),
        block_size=BLOCK, query_start_loc_cpu=tuple(qsl), seq_lens_cpu=lens)
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([i for s in seqs for i in range(len(s))])
    with forward_context(ForwardContext(attn=meta, kv_caches=kv, dispatcher=cpu_dispatcher(mode))):
        logits = model.compute_logits(model(ids, pos))
    return [logits[a:b] for a, b in zip(qsl[:-1], qsl[1:])]


def copy_checkpoint(src, dst, edit) -> str:
    """A copy of the one-file checkpoint `src` (its config files too) whose tensors dict went
    through `edit`."""
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
            b.write(a.read())
    sd = load_file(os.path.join(src, "model.safetensors"))
    edit(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    return str(dst)

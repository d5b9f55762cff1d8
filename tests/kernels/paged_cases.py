"""Builders for paged-attention test cases (shared by tests/kernels and tests/gpu)."""
from __future__ import annotations

import torch

from detent.selection.context import AttentionMetadata


class PagedCase:
    """A set of sequences with a paged KV cache whose earlier tokens are
    already cached. `q, k, v` for ALL positions are fixed up front, so the
    same sequence can be run as one prefill, in chunks, or token by token."""

    def __init__(self, seq_lens, h, kvh, d, block_size=16, dtype=torch.float32, device="cpu", seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.h, self.kvh, self.d, self.bs, self.dtype, self.device = h, kvh, d, block_size, dtype, device
        self.seq_lens = list(seq_lens)
        self.q = [torch.randn(L, h, d, generator=g).to(dtype).to(device) for L in seq_lens]
        self.k = [torch.randn(L, kvh, d, generator=g).to(dtype).to(device) for L in seq_lens]
        self.v = [torch.randn(L, kvh, d, generator=g).to(dtype).to(device) for L in seq_lens]
        nblk = [-(-L // block_size) for L in seq_lens]
        total = sum(nblk) + 3
        perm = torch.randperm(total, generator=g)[: sum(nblk)]  # scattered, non-contiguous blocks
        self.tables, i = [], 0
        for n in nblk:
            self.tables.append(perm[i:i + n].to(torch.int32))
            i += n
        self.num_blocks = total
        self.max_blocks = max(nblk)

    def fresh_cache(self):
        # NaN poison: an unwritten or wrongly-read slot turns the output into NaN
        return torch.full((2, self.num_blocks, self.bs, self.kvh, self.d), float("nan"),
                          dtype=self.dtype, device=self.device)

    def step(self, kv_cache, chunks, order=None):
        """Run one step where sequence b contributes its tokens [start_b, end_b)
        given by chunks[b] = (start, end); earlier tokens must already be cached.
        Returns q, k, v, meta for the step (sequence order `order`)."""
        order = list(range(len(chunks))) if order is None else order
        qs, ks, vs, slots, qsl, lens, tabs = [], [], [], [], [0], [], []
        for b in order:
            s, e = chunks[b]
            qs.append(self.q[b][s:e]); ks.append(self.k[b][s:e]); vs.append(self.v[b][s:e])
            p = torch.arange(s, e)
            slots.append(self.tables[b].long()[p // self.bs] * self.bs + p % self.bs)
            qsl.append(qsl[-1] + e - s)
            lens.append(e)
            t = torch.zeros(self.max_blocks, dtype=torch.int32)
            t[: len(self.tables[b])] = self.tables[b]
            tabs.append(t)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.stack(tabs).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            num_seqs=len(order), num_tokens=qsl[-1],
            max_seqlen_q=max(chunks[b][1] - chunks[b][0] for b in order),
            max_seqlen_k=max(lens), block_size=self.bs,
            query_start_loc_cpu=tuple(qsl), seq_lens_cpu=tuple(lens))
        return torch.cat(qs), torch.cat(ks), torch.cat(vs), meta

    def prefill_prefix(self, kv_cache, upto):
        """Write k, v of positions [0, upto[b]) of every sequence into the cache."""
        from detent.kernels.rowwise_triton import store_kv_reference
        for b, u in enumerate(upto):
            if u:
                p = torch.arange(u)
                slot = (self.tables[b].long()[p // self.bs] * self.bs + p % self.bs).to(self.device)
                store_kv_reference(self.k[b][:u], self.v[b][:u], kv_cache, slot)

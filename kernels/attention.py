"""Paged attention candidates (torch, CPU reference path).

`paged_split` reduces every query row over the KV in fixed splits of
`split_tokens` absolute KV positions, each split one fixed-shape product
(broadcast and sum, so every output element is one reduction of one shape;
a library matmul is not row-invariant on every ISA path), and merges the splits' partial softmax states in ascending order. Queries
are processed in fixed chunks of `q_chunk` rows. Nothing about a row's
arithmetic depends on how many other queries there are, where its prefill
was cut, or what was cached: the invariant candidate.

`sdpa` gathers the sequence's KV and calls torch SDPA on the real query
count: the stock choice (its bits change between a decode step and the same
position inside a prefill).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from detent.kernels.registry import register


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, KVH, D]; k, v: [T, KVH, D]."""
    _, nb, bs, kvh, d = kv_cache.shape
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _gather_seq(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence: [L, KVH, D] each."""
    _, nb, bs, kvh, d = kv_cache.shape
    nblk = -(-seq_len // block_size)
    blocks = block_table[:nblk].long()
    k = kv_cache[0].index_select(0, blocks).reshape(nblk * bs, kvh, d)[:seq_len]
    v = kv_cache[1].index_select(0, blocks).reshape(nblk * bs, kvh, d)[:seq_len]
    return k, v


@register("attention", "paged_split", params=("split_tokens", "q_chunk"), devices=("cpu", "cuda"))
def attention_paged_split(q, k, v, kv_cache, meta, scale: float, split_tokens: int,
                          q_chunk: int = 16) -> torch.Tensor:
    store_kv(k, v, kv_cache, meta.slot_mapping)
    t, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    S, QC = split_tokens, q_chunk
    out = torch.empty_like(q)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    dev = q.device
    ar_s = torch.arange(S, device=dev)
    ar_q = torch.arange(QC, device=dev)
    for b in range(meta.num_seqs):
        qs, qe, L = qsl[b], qsl[b + 1], lens[b]
        lq = qe - qs
        if lq == 0:
            continue
        start = L - lq
        K, V = _gather_seq(kv_cache, meta.block_tables[b], L, meta.block_size)
        nsplit = -(-L // S)
        pad = nsplit * S - L
        if pad:
            K = torch.cat([K, K.new_zeros(pad, kvh, d)])
            V = torch.cat([V, V.new_zeros(pad, kvh, d)])
        Ks = K.float().view(nsplit, S, kvh, d).permute(0, 2, 1, 3).contiguous()  # [ns, KVH, S, D]
        Vs = V.float().view(nsplit, S, kvh, d).permute(0, 2, 1, 3).contiguous()  # [ns, KVH, S, D]
        for c0 in range(0, lq, QC):
            n = min(QC, lq - c0)
            qc = q[qs + c0: qs + c0 + n].float()
            if n < QC:
                qc = torch.cat([qc, qc.new_zeros(QC - n, h, d)])
            # [QC, KVH, G, D] -> [KVH, G*QC, D]  (row = g * QC + i)
            qc = qc.view(QC, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * QC, d)
            pos = start + c0 + ar_q  # [QC] absolute positions
            m = torch.full((kvh, g * QC, 1), float("-inf"), device=dev)
            l = torch.zeros((kvh, g * QC, 1), device=dev)
            acc = torch.zeros((kvh, g * QC, d), device=dev)
            last = min(nsplit, (start + c0 + n - 1) // S + 1)
            for s in range(last):
                # products as broadcast + sum, not matmul: a fixed-shape reduction per output
                # element, the same for every row. MKL's matmul computes a row by its position
                # in the [G*QC, S] x [S, D] product on its AVX2 path (tests/kernels/test_cpu_isa.py)
                sc = (qc[:, :, None, :] * Ks[s][:, None]).sum(-1) * scale  # [KVH, G*QC, S]
                mask = (s * S + ar_s)[None, :] > pos[:, None]  # [QC, S]
                sc = sc.masked_fill(mask.repeat(g, 1)[None], float("-inf"))
                m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
                m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
                p = torch.exp(sc - m_safe)
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(-1, keepdim=True)
                acc = acc * alpha + (p[..., None] * Vs[s][:, None]).sum(-2)  # [KVH, G*QC, D]
                m = m_new
            o = (acc / l).view(kvh, g, QC, d).permute(2, 0, 1, 3).reshape(QC, h, d)
            out[qs + c0: qs + c0 + n] = o[:n].to(q.dtype)
    return out


@register("attention", "sdpa", devices=("cpu", "cuda"))
def attention_sdpa(q, k, v, kv_cache, meta, scale: float) -> torch.Tensor:
    store_kv(k, v, kv_cache, meta.slot_mapping)
    t, h, d = q.shape
    kvh = k.shape[1]
    out = torch.empty_like(q)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for b in range(meta.num_seqs):
        qs, qe, L = qsl[b], qsl[b + 1], lens[b]
        lq = qe - qs
        if lq == 0:
            continue
        K, V = _gather_seq(kv_cache, meta.block_tables[b], L, meta.block_size)
        K = K.to(q.dtype).repeat_interleave(h // kvh, dim=1).transpose(0, 1)  # [H, L, D]
        V = V.to(q.dtype).repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        qb = q[qs:qe].transpose(0, 1)  # [H, lq, D]
        pos_q = torch.arange(L - lq, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= pos_q[:, None]  # [lq, L]
        o = F.scaled_dot_product_attention(qb, K, V, attn_mask=mask, scale=scale)
        out[qs:qe] = o.transpose(0, 1)
    return out

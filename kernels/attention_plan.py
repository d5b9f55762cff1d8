"""What the paged Triton attention (kernels/attention_triton.py) launches for a step,
decided on the host from the step itself: the decode mapping, the short launch for a
chunk's decodes, parallel splits and their combine, and the compiles each combination
needs (`kernel_variants`, which the warm start reaches: engine/warmup.py). A selection
fixes the parameters; none of these moves a row's bits (tests/gpu)."""
from __future__ import annotations

from dataclasses import dataclass

import triton


# the split short launch's partials, in (split, row, head) rows of head_dim + 2 floats: 2^17 is
# 68 MB at head dim 128, what 64 padded sequences of 4 rows, 32 heads and 16 splits (a 4,096-token
# context) take. A longer context walks the splits in one program past that (the same bits),
# rather than take memory the KV cache could hold (a 131,072-token context would need 2.2 GB)
SHORT_PARTIAL_ROWS = 1 << 17


@dataclass(frozen=True)
class LaunchPlan:
    block_q: int
    decode: bool  # a decode-only step: program b serves sequence b
    split: bool  # sequences of at most short_q queries are left to the short launch
    has_short: bool  # ... and the short launch runs
    short_m: int
    short_q: int
    short_warps: int  # the short launch's warps and prefetch stages (`short_launch_config`)
    short_stages: int
    short_parallel: bool  # ... one program per KV split, then the combine kernel for its rows
    n_qtiles: int
    max_splits: int
    parallel: bool  # one program per KV split, then the combine kernel


def launch_plan(t: int, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, query_lens, kvh: int, g: int,
                sms: int, *, block_m: int, split_tokens: int, combine: str = "auto", rowsum: str = "mma",
                short_launch: bool = True, tile_loop: str = "nested", short_combine: str = "auto") -> LaunchPlan:
    """What `attention_triton_paged` launches for a step (host values only).

    A selection fixes the parameters; these are decided by the step itself,
    and each combination is its own compile (`kernel_variants`)."""
    block_q = block_m // g
    # decode-only step: the launch maps program b to sequence b (same arithmetic per row)
    decode = max_seqlen_q == 1 and t == num_seqs
    # a mixed step's tile follows its longest query (128 rows for a long chunk); a decode row
    # in such a tile uses G of its rows. With the row sum through the MMA the tile is
    # numerics-neutral, so sequences whose queries fit a short tile get a launch of their own
    short_m = max(16, triton.next_power_of_2(g))
    short_q = short_m // g  # queries of one sequence that fit a short tile
    split = short_launch and not decode and rowsum == "mma" and block_m > short_m
    has_short = False
    if split:  # without host copies of the query lengths, launch it: its programs skip long sequences
        has_short = min(query_lens) <= short_q if query_lens else True
    n_qtiles = t if decode else t // block_q + num_seqs
    max_splits = triton.cdiv(max(max_seqlen_k, 1), split_tokens)
    if combine == "auto":
        parallel = max_splits > 1 and n_qtiles * kvh < sms
    elif combine in ("parallel", "sequential"):
        parallel = combine == "parallel" and max_splits > 1  # one split: nothing to combine
    else:
        raise ValueError(f"attention/triton_paged: combine={combine!r} must be 'auto', 'parallel' or 'sequential'")
    if short_combine not in ("auto", "parallel", "sequential"):
        raise ValueError(f"attention/triton_paged: short_combine={short_combine!r} must be 'auto', 'parallel' or "
                         f"'sequential'")
    # split only with more than one split, and with its fp32 partials (a slot of short_q rows
    # per sequence, every head, every split of the longest KV) within SHORT_PARTIAL_ROWS
    fits = 1 < max_splits and max_splits * num_seqs * short_q * kvh * g <= SHORT_PARTIAL_ROWS
    short_warps, short_stages, short_parallel = short_launch_config(num_seqs * kvh, tile_loop,
                                                                    short_combine if fits else "sequential")
    return LaunchPlan(block_q, decode, split, has_short, short_m, short_q, short_warps, short_stages,
                      short_parallel, n_qtiles, max_splits, parallel)


def short_launch_config(programs: int, tile_loop: str = "nested", combine: str = "auto") -> tuple[int, int, bool]:
    """(num_warps, num_stages, parallel) of the short launch: one program per (sequence, KV
    head) on a 16-row tile, splits walked in order (the decode launch's arithmetic), or with
    `parallel` one program per (sequence, KV head, split) and then the combine kernel for the
    short rows, which is the decode launch's split form (the same bits: tests/gpu).

    Up to 512 programs it splits (2 warps, 4 stages from 128 programs, as the decode launch
    at 128-511 (selection/programs/attention.py); 4 warps and 2 stages below): a mixed step
    of 26 decodes beside a 1,038-token chunk took 1.95 ms over the 32 layers in a sequential
    short launch of 216 programs, the same 26 decodes in a decode step's split launch 1.29
    (H200, Llama-3.1-8B shapes, 1.1k contexts: benchmarks/mixed_kernels.py, docs/
    performance.md "Lease 18"). The whole-step graphs launch it at their padded sequence count
    (64 for 17 to 64 sequences: engine/mixed_graph.py), so the limit is 512 and not the decode
    launch's 511. From 513 programs, sequential: 2 warps and no prefetch stage with a loop per
    split (in a mixed step of 105 decodes beside a prompt chunk, 4 warps and 2 stages took
    5.65 ms over the 32 layers, 2 warps and 1 stage 5.17: "Lease 12"); 2 warps and 3 stages
    with one loop over the splits (tile_loop "auto" or "prefetch"; lease 17, us per layer:
    105 decodes alone 128.9 at 3 stages against 150.3 at 1). Warps, stages and the split do
    not move a row's bits (rowsum="mma"; tests/gpu). `combine` "parallel" or "sequential"
    forces the form (benchmarks/attn_mixed.py compares them)."""
    parallel = programs <= 512 if combine == "auto" else combine == "parallel"
    if parallel:
        return (2, 4, True) if programs >= 128 else (4, 2, True)
    if programs >= 512:
        return (2, 1, False) if tile_loop == "nested" else (2, 3, False)
    return (4, 2, False)


def kernel_variants(plan: LaunchPlan, *, block_m: int, num_warps: int = 4, num_stages: int = 2,
                    **_selection) -> set[tuple]:
    """The compiles a step with this plan needs (beyond the selection's fixed constexprs):
    (kernel, BLOCK_M, PARALLEL, DECODE, SHORT, SKIP_Q, num_warps, num_stages)."""
    out = {("paged", block_m, plan.parallel, plan.decode, False, plan.short_q if plan.split else 0, num_warps,
            num_stages)}
    if plan.parallel:
        out.add(("combine", plan.decode))
    if plan.split and plan.has_short:
        out.add(("paged", plan.short_m, plan.short_parallel, False, True, 0, plan.short_warps, plan.short_stages))
        if plan.short_parallel:
            out.add(("combine_short", plan.short_q))
    return out


def step_variants(selection: dict, *, query_lens, kv_lens, num_heads: int, num_kv_heads: int,
                  num_sms: int, **_site) -> set[tuple]:
    """`kernel_variants` of a step given by its query and KV lengths per sequence."""
    keys = ("split_tokens", "block_m", "combine", "rowsum", "short_launch", "tile_loop", "short_combine")
    plan = launch_plan(sum(query_lens), len(query_lens), max(query_lens), max(kv_lens), tuple(query_lens),
                       num_kv_heads, num_heads // num_kv_heads, num_sms,
                       **{k: selection[k] for k in keys if k in selection})
    return kernel_variants(plan, **{k: v for k, v in selection.items() if k != "impl"})

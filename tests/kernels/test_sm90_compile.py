"""Kernels changed since the last device run (the MoE glue of fuse_glue, the
RMSNorm that reads heads in place, the fused Gumbel-max sampler, top-p's mask, the paged
attention's short launch, its split form and its combine's skip and row slots) compiled for the H200 (sm_90) on this CPU
machine: Triton lowers them to PTX and ptxas assembles a cubin, no GPU
needed. Catches what the interpreter cannot (a construct the compiler
refuses), and checks two properties of the code itself: the fp32 combine has
no fused multiply-add, so it rounds like torch's separate multiply and add;
and the attention's KV loop keeps its next copies in flight only when the
block table is read a tile ahead.

The compiler runs in a child process: this one runs Triton's interpreter,
which patches triton.language for the kernels the other tests interpret."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

SCRIPT = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from detent.kernels import moe_triton as mt

import re

def compile_(lazy, sig, consts, aligned=(), **opts):
    # aligned: the arguments the launch specializes as multiples of 16 (pointers, strides),
    # which the copies' 16-byte vectors need
    fn = triton.jit(lazy.fn, **lazy.jit_kw)
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return {"cubin_bytes": len(k.asm["cubin"]), "fma": k.asm["ptx"].count("fma."),
            "async_waits": [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", k.asm["ttgir"])],
            "dot_waits": len(re.findall(r"ttng\.warp_group_dot_wait", k.asm["ttgir"]))}

from detent.kernels import rowwise_triton as rw
comb = {"TOPK": 8, "BLOCK_H": 1024}
out = {
    "align": compile_(mt._align_kernel, {"ids_ptr": "*i64", "hist_ptr": "*i32", "rows_ptr": "*i32",
                                         "blk_expert_ptr": "*i32", "R": "i32", "NUM_BLK": "i32"},
                      {"HCH": 512, "E_PAD": 128, "BLOCK_M": 16, "CH": 64, "SUB": 64, "COUNTED": False}, num_warps=4),
    "align_prefill": compile_(mt._align_kernel, {"ids_ptr": "*i64", "hist_ptr": "*i32", "rows_ptr": "*i32",
                                                 "blk_expert_ptr": "*i32", "R": "i32", "NUM_BLK": "i32"},
                              {"HCH": 4096, "E_PAD": 128, "BLOCK_M": 64, "CH": 512, "SUB": 64, "COUNTED": True},
                              num_warps=4),
    "align_count": compile_(mt._align_count_kernel, {"ids_ptr": "*i64", "hist_ptr": "*i32", "R": "i32"},
                            {"E_PAD": 128, "CH": 512}, num_warps=4),
    "route": compile_(mt._route_kernel, {"logits_ptr": "*bf16", "topw_ptr": "*bf16", "topi_ptr": "*i64", "E": "i32",
                                         "stride": "i32"}, {"TOPK": 8, "TOPK_PAD": 8, "E_PAD": 128, "RENORM": True},
                      num_warps=1),
    "rms_norm": compile_(rw._rms_norm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                               "ro_ptr": "*bf16", "eps": "fp32", "H": "i32", "NH": "i32", "sx": "i32",
                                               "sx1": "i32", "sr": "i32", "sy": "i32", "sro": "i32"},
                         {"HAS_RES": False, "BLOCK": 128}, num_warps=4),
    "rms_norm_rows": compile_(rw._rms_norm_rows_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                                         "eps": "fp32", "H": "i32", "NH": "i32", "n_rows": "i32",
                                                         "sx": "i32", "sx1": "i32", "sy": "i32"},
                              {"BLOCK": 128, "ROWS": 16}, num_warps=4),
}
from detent.kernels import gumbel_triton as gt
out["gumbel"] = compile_(gt._gumbel_argmax_kernel, {"z_ptr": "*fp32", "key_ptr": "*i64", "val_ptr": "*fp64",
                                                    "idx_ptr": "*i64", "V": "i32", "sz": "i32", "NCH": "i32"},
                         {"CHUNK": 4096, "BLOCK": 1024}, num_warps=8, enable_fp_fusion=False)
out["gumbel_first_max"] = compile_(gt._first_max_kernel, {"val_ptr": "*fp64", "idx_ptr": "*i64", "out_ptr": "*i64",
                                                          "NCH": "i32"}, {"NCH_PAD": 32}, num_warps=1)
from detent.kernels import nucleus_triton as nt
for final in (False, True):
    out["top_p_final" if final else "top_p_level"] = compile_(
        nt._top_p_kernel, {"p_ptr": "*fp32", "top_p_ptr": "*fp64", "limit_ptr": "*i64", "part_ptr": "*i64",
                           "state_ptr": "*i64", "cnt_ptr": "*i32", "keep_ptr": "*u8", "V": "i32", "B": "i32",
                           "NCH": "i32", "level": "i32", "sp": "i32", "sk": "i32"},
        {"D": 3, "LEVELS": 10, "NCH_PAD": 32, "CHUNK": 4096, "BLOCK": 1024, "FINAL": final}, num_warps=8)
out["top_p_row"] = compile_(nt._top_p_row_kernel, {"p_ptr": "*fp32", "top_p_ptr": "*fp64", "limit_ptr": "*i64",
                                                   "keep_ptr": "*u8", "V": "i32", "sp": "i32", "sk": "i32"},
                           {"D": 2, "LEVELS": 15, "BLOCK": 2048}, num_warps=8)
for dt in ("bf16", "fp32"):
    sig = {"y_ptr": "*" + dt, "w_ptr": "*" + dt, "out_ptr": "*" + dt, "H": "i32"}
    out["combine_" + dt] = compile_(mt._combine_kernel, sig, comb, num_warps=4, enable_fp_fusion=False)
    out["combine_" + dt + "_fused"] = compile_(mt._combine_kernel, sig, comb, num_warps=4, enable_fp_fusion=True)
from detent.kernels import attention_triton as at
attn = {p: "*bf16" for p in ("q_ptr", "kc_ptr", "vc_ptr", "o_ptr")}
attn.update({p: "*fp32" for p in ("pm_ptr", "pl_ptr", "pacc_ptr")})
attn.update({p: "*i32" for p in ("qsl_ptr", "seqlen_ptr", "bt_ptr")}, scale="fp32")
attn.update({p: "i32" for p in ("num_seqs", "sq_t", "sq_h", "sc_blk", "sc_off", "sc_h", "so_t", "so_h", "sbt",
                                "sp_s", "sp_t", "sp_h", "spa_s", "spa_t", "spa_h")})
base = {"G": 4, "D": 128, "BLOCK_N": 64, "SPLIT": 256, "PAGE": 16, "IEEE": False, "ROWSUM_MMA": True,
        "EXP2": False, "SPLIT_MASK": False, "HEAVY_FIRST": False, "FLAT": False, "PREFETCH": False, "DEFER": False}
out["attention_long_skip"] = compile_(at._paged_attn_kernel, attn, {**base, "BLOCK_M": 128, "BLOCK_Q": 32,
                                      "PARALLEL": False, "DECODE": False, "SHORT": False, "SKIP_Q": 4}, num_warps=8)
out["attention_short"] = compile_(at._paged_attn_kernel, attn, {**base, "BLOCK_M": 16, "BLOCK_Q": 4,
                                  "PARALLEL": False, "DECODE": False, "SHORT": True, "SKIP_Q": 0}, num_warps=4)
long = {**base, "BLOCK_M": 128, "BLOCK_Q": 32, "PARALLEL": False, "DECODE": False, "SHORT": False, "SKIP_Q": 4}
aligned = [a for a in attn if a.endswith("_ptr")] + ["sq_t", "sc_blk", "sc_off", "sc_h", "so_t"]
for loop, flags in (("nested", {}), ("flat", {"FLAT": True}), ("prefetch", {"FLAT": True, "PREFETCH": True})):
    out["attention_long_" + loop + "_st3"] = compile_(at._paged_attn_kernel, attn, {**long, **flags}, aligned,
                                                      num_warps=8, num_stages=3)
for defer in (False, True):  # the row sum's MMA folded a tile late (defer_rowsum)
    out["attention_long_defer" if defer else "attention_long_nodefer"] = compile_(
        at._paged_attn_kernel, attn, {**long, "EXP2": True, "DEFER": defer}, aligned, num_warps=8, num_stages=2)
exp2 = {**base, "EXP2": True, "SPLIT_MASK": True}
out["attention_exp2_long"] = compile_(at._paged_attn_kernel, attn, {**exp2, "BLOCK_M": 128, "BLOCK_Q": 32,
                                      "PARALLEL": False, "DECODE": False, "SHORT": False, "SKIP_Q": 4}, num_warps=8)
out["attention_exp2_decode_parallel"] = compile_(at._paged_attn_kernel, attn, {**exp2, "BLOCK_M": 16, "BLOCK_Q": 4,
                                                 "PARALLEL": True, "DECODE": True, "SHORT": False, "SKIP_Q": 0},
                                                 num_warps=2, num_stages=4)
comb_sig = {"o_ptr": "*bf16", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "qsl_ptr": "*i32",
            "seqlen_ptr": "*i32", **{p: "i32" for p in ("num_seqs", "skip_q", "so_t", "so_h", "sp_s", "sp_t", "sp_h",
                                                        "spa_s", "spa_t", "spa_h")}, "scale": "fp32"}
out["attention_combine_skip"] = compile_(at._combine_kernel, comb_sig, {"D": 128, "SPLIT": 256, "DECODE": False,
                                                                        "EXP2": False, "SHORT_Q": 0}, num_warps=2)
out["attention_combine_exp2"] = compile_(at._combine_kernel, comb_sig, {"D": 128, "SPLIT": 256, "DECODE": True,
                                                                        "EXP2": True, "SHORT_Q": 0}, num_warps=2)
# the short launch split into one program per KV split, and the combine over its row slots
out["attention_short_parallel"] = compile_(at._paged_attn_kernel, attn, {**base, "BLOCK_M": 16, "BLOCK_Q": 4,
                                           "PARALLEL": True, "DECODE": False, "SHORT": True, "SKIP_Q": 0},
                                           num_warps=2, num_stages=4)
out["attention_combine_short"] = compile_(at._combine_kernel, comb_sig, {"D": 128, "SPLIT": 256, "DECODE": False,
                                                                         "EXP2": False, "SHORT_Q": 4}, num_warps=2)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled():
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not os.path.exists(os.path.join(bin_dir, "ptxas")):
        pytest.skip("this triton has no CUDA backend (ptxas): nothing to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default today; set so that it does not warn
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["align", "align_prefill", "align_count", "route", "combine_bf16", "combine_fp32",
                                  "rms_norm", "rms_norm_rows", "gumbel", "gumbel_first_max", "top_p_level", "top_p_final", "top_p_row",
                                  "attention_long_skip",
                                  "attention_short",
                                  "attention_combine_skip", "attention_exp2_long", "attention_exp2_decode_parallel",
                                  "attention_combine_exp2", "attention_long_prefetch_st3", "attention_short_parallel",
                                  "attention_combine_short"])
def test_kernel_compiles_for_sm90(compiled, name):
    assert compiled[name]["cubin_bytes"] > 0


def test_reading_the_block_table_a_tile_ahead_lets_the_kv_copies_fly(compiled):
    # the long launch at 3 stages: with each tile's block-table entries loaded in the same
    # iteration as its K and V copies, the loop body waits for every outstanding copy
    # (num = 0), so the next tile's copies overlap no compute; with the entries read a tile
    # ahead (tile_loop="prefetch") the wait leaves the newest copies in flight
    # (docs/performance.md "Lease 17")
    for loop in ("nested", "flat"):
        waits = compiled["attention_long_" + loop + "_st3"]["async_waits"]
        assert waits and max(waits) == 0, (loop, waits)
    assert max(compiled["attention_long_prefetch_st3"]["async_waits"]) >= 1


def test_deferring_the_row_sum_leaves_one_mma_wait_per_kv_tile(compiled):
    # the long launch's KV loop waits for QK^T (which also retires the previous tile's P.V)
    # and then, alone, for the row sum's MMA; folding each row sum at the next tile leaves
    # that MMA in flight with P.V until the next QK^T's wait (docs/performance.md "Lease 18").
    # Three waits in the kernel (two in the loop, one after it) against two
    assert compiled["attention_long_nodefer"]["dot_waits"] == 3
    assert compiled["attention_long_defer"]["dot_waits"] == 2


def test_combine_has_no_fma_as_launched(compiled):
    # combine_fused launches with enable_fp_fusion=False; with fusion on, the
    # compiler would contract y * w + acc in fp32 (the counter-check)
    assert compiled["combine_fp32"]["fma"] == compiled["combine_bf16"]["fma"] == 0
    assert compiled["combine_fp32_fused"]["fma"] > 0

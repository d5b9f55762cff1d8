"""The attention program's `impl` knob (triton_paged | fa4) and its FA4 branch:
exact selections with and without flash-attn-4 among the facts, FA4's own
selection transcribed (tiles from head dim, its split heuristic), the tuple's
legality checks, and the cut rule that keeps one implementation's pins out
of the other's selection."""
import re

import pytest

from detent.selection import CommitmentTuple, TupleError, default_tuple, parse_program, programs, solve
from detent.selection.facts import default_facts_for
from tests.selection.conftest import ATTN_SITE, CPU, GPU, rt

FA4 = "4.0.0b36"
SITE = dict(ATTN_SITE, num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
# the Triton attention's knobs at their defaults (selection/programs/attention.py)
KNOBS = {"softmax": "exp2", "overlap_short": True, "tile_loop": "nested", "defer_rowsum": False}
# decode batch 1 and 64, one 8k prefill, a mixed step, a long-context decode
POINTS = [rt(num_seqs=1, max_seqlen_q=1, max_seqlen_k=8192), rt(num_seqs=64, max_seqlen_q=1, max_seqlen_k=1024),
          rt(num_seqs=1, max_seqlen_q=8192, max_seqlen_k=8192), rt(num_seqs=9, max_seqlen_q=300, max_seqlen_k=5000),
          rt(num_seqs=2, max_seqlen_q=1, max_seqlen_k=131072)]
FA4_128 = {"impl": "fa4", "tile_m": 128, "tile_n": 128, "num_threads": 384, "pack_gqa": True, "num_splits": 1,
           "mma_pv_is_rs": True, "intra_wg_overlap": True, "page_size": 16}


def sol(facts, site=SITE):
    return solve(programs.load("attention"), {**facts, **site})


def test_without_fa4_the_gpu_selection_is_todays_and_the_knob_says_how_to_install():
    s = sol(GPU)
    assert s.knobs["impl"] == (("triton_paged", "fa4"), "triton_paged")
    d = s.default_assignment()
    assert d == {"num_splits": 1, "split_tokens": 256, "impl": "triton_paged", "split_stride": 256, **KNOBS}
    p = s.compile(d)
    off = {"split_mask": False, **KNOBS}  # knobs' defaults
    assert p(**POINTS[0]) == {"impl": "triton_paged", "split_tokens": 256, "block_n": 64, "rowsum": "mma",
                              "block_m": 16, "num_warps": 8, "num_stages": 2, "combine": "parallel", **off}
    assert p(**POINTS[2]) == {"impl": "triton_paged", "split_tokens": 256, "block_n": 64, "rowsum": "mma",
                              "block_m": 128, "num_warps": 8, "num_stages": 2, "combine": "auto", **off}
    ahead = s.compile(dict(d, tile_loop="prefetch"))
    assert ahead(**POINTS[2])["num_stages"] == 3 and ahead(**POINTS[0])["num_stages"] == 2  # prompt tiles only
    many = rt(num_seqs=64, max_seqlen_q=1, max_seqlen_k=1024)  # 512 (sequence, KV head) programs
    assert (p(**many)["num_stages"], s.compile(dict(d, tile_loop="auto"))(**many)["num_stages"]) == (1, 3)
    on = s.compile(dict(d, softmax="exp2", overlap_short=True))(**POINTS[2])
    assert (on["softmax"], on["split_mask"], on["overlap_short"]) == ("exp2", False, True)  # split_mask: not invariant on the H200
    why = s.why_illegal(dict(d, impl="fa4"))
    assert why.startswith("program 'attention': no pin values are legal with knobs {'impl': 'fa4'")
    assert 'needs flash-attn-4 4.0.0b36: pip install "detent[fa4]"' in why


def test_with_fa4_one_selection_serves_every_step():
    s = sol(dict(GPU, fa4=FA4))
    p = s.compile(dict(s.default_assignment(), impl="fa4"))
    for point in POINTS:  # decode, prefill, mixed: the same kernel and parameters, by construction
        assert p(**point) == FA4_128
    # stock reads the batch, but FA4 cannot split on SM90: the same selection
    st = s.compile({"impl": "fa4"}, mode="stock")
    assert all(st(**point) == FA4_128 for point in POINTS)
    # the knob left at its default: today's Triton selection
    assert s.compile(s.default_assignment())(**POINTS[0])["impl"] == "triton_paged"


# flash_attn/cute/interface.py (4.0.0b36) _tile_size_fwd_sm90, causal, not local: (tile_m, tile_n, rs, overlap)
FA4_SM90_TILES = {64: (192, 128, True, True), 96: (192, 128, False, True), 128: (128, 128, True, True),
                  192: (128, 112, True, True), 256: (128, 80, True, True)}


@pytest.mark.parametrize("d", sorted(FA4_SM90_TILES))
def test_fa4_tiles_follow_head_dim(d):
    s = sol(dict(GPU, fa4=FA4), dict(SITE, head_dim=d))
    sel = s.compile(dict(s.default_assignment(), impl="fa4"))(**POINTS[3])
    assert (sel["tile_m"], sel["tile_n"], sel["mma_pv_is_rs"], sel["intra_wg_overlap"]) == FA4_SM90_TILES[d]
    mha = sol(dict(GPU, fa4=FA4), dict(SITE, head_dim=d, num_kv_heads=32))
    assert mha.compile(dict(mha.default_assignment(), impl="fa4"))(**POINTS[3])["pack_gqa"] is False


def _fa4_split(num_seqs, max_q, max_k, kvh=8, gqa=4, num_sms=132, tile_m=128, tile_n=128):
    """FA4's num_splits_heuristic with pack_gqa, written out independently."""
    total = num_seqs * kvh * -(-max_q * gqa // tile_m)
    n_blocks = -(-max_k // tile_n)
    if n_blocks <= 4 or total == 0:
        return 1
    return max(1, min(num_sms // total, 128, n_blocks))


def test_the_split_count_is_the_pin_fa4_would_read_from_the_batch():
    s = sol(dict(GPU, fa4=FA4))
    assert s.pins == ("num_splits", "split_tokens")
    knobs = tuple({"impl": "fa4", "split_stride": 256, **KNOBS}[k]
                  for k in s.vra.knob_names)
    for point in POINTS:
        args = (point["num_seqs"], point["max_seqlen_q"], point["max_seqlen_k"])
        vals = dict(zip(s.pins, s.vra.values_at(tuple(point[n] for n in s.vra.inputs), knobs)))
        assert vals["num_splits"] == _fa4_split(*args), point
    assert _fa4_split(1, 1, 8192) == 16 and _fa4_split(64, 1, 1024) == 1  # it does read the batch
    assert set(s.candidates["num_splits"]) > {1, 16}


def test_tuple_chooses_fa4_per_deployment_and_refuses_a_split(tmp_path):
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 128,
           "vocab_size": 100}
    facts = default_facts_for(cfg, device="cuda", dtype="bfloat16", max_context=8192, num_sms=132, arch="sm90",
                              triton=True, fa4=FA4)
    t = default_tuple(facts, ("attention",))
    assert t.families["attention"] == {"pins": {"num_splits": 1, "split_tokens": 256},
                                       "knobs": {"impl": "triton_paged", "split_stride": 256, **KNOBS}, "sites": {}}
    t.families["attention"]["knobs"]["impl"] = "fa4"
    path = tmp_path / "t.json"
    t.save(str(path))
    CommitmentTuple.load(str(path)).validate(facts)  # flipping the knob alone is legal
    t.families["attention"]["pins"]["num_splits"] = 2
    t.save(str(path))
    with pytest.raises(TupleError, match=r"pin 'num_splits' = 2 is not legal here; its legal values: \[1\] "
                                         r"\(require `num_splits == 1` fails"):
        CommitmentTuple.load(str(path)).validate(facts)
    # the same tuple on a deployment without flash-attn-4: refused, saying how to install it
    bare = dict(facts, fa4="")
    t.facts, t.families["attention"]["pins"]["num_splits"] = bare, 1
    t.save(str(path))
    with pytest.raises(TupleError, match=r'pip install "detent\[fa4\]"'):
        CommitmentTuple.load(str(path)).validate(bare)
    with pytest.raises(TupleError, match=r"deployment fact 'fa4' differs: the tuple was made for '', this "
                                         r"deployment has '4.0.0b36'"):
        CommitmentTuple.load(str(path)).validate(facts)


def test_fa4_needs_sm90_and_16_bit():
    for facts, msg in ((dict(GPU, fa4=FA4, arch="sm100"), "transcribed .* for SM90 only"),
                       (dict(GPU, fa4=FA4, dtype="float32"), "runs bf16 or fp16")):
        s = sol(facts, dict(SITE, dtype=facts["dtype"]))
        assert s.is_legal(s.default_assignment())
        assert re.search(msg, s.why_illegal(dict(s.default_assignment(), impl="fa4")))


def test_cpu_is_unchanged():
    s = sol(CPU, ATTN_SITE)
    assert s.pins == ("split_tokens",) and list(s.knobs) == ["split_stride"]
    assert s.compile(s.default_assignment())(**rt(num_seqs=3, max_seqlen_q=1, max_seqlen_k=900)) == {
        "impl": "paged_split", "split_tokens": 256, "q_chunk": 16}
    f = default_facts_for({"hidden_size": 64, "num_attention_heads": 4}, fa4=FA4)
    assert f["fa4"] == ""  # FA4 is a CUDA fact
    assert default_tuple(f, ("attention",)).families["attention"] == {
        "pins": {"split_tokens": 256}, "knobs": {"split_stride": 256}, "sites": {}}


KNOB_PROG = '''
def select(n: Runtime[int, 1, 64]):
    impl = knob("impl", ("a", "b"), "a")
    if impl == "b":
        return {"impl": "b", "tile": next_pow2(n)}
    return {"impl": "a", "split": cdiv(64, n)}
'''


def test_a_knob_chosen_selection_point_is_pinned_inside_its_path():
    s = solve(parse_program(KNOB_PROG, "k.py", "k"), {}, cache=False)
    assert sorted(s.pins) == ["split", "tile"]
    sel = s.compile({"split": 64, "tile": 8, "impl": "b"})
    # the pins of "a" do not reach "b"'s selection (pinning the merged value would have put split=64 there)
    assert sel(n=3) == sel(n=50) == {"impl": "b", "tile": 8}
    assert s.compile({"split": 64, "tile": 8, "impl": "a"})(n=5) == {"impl": "a", "split": 64}


def test_cli_default_tuple_with_fa4(tmp_path, capsys):
    import json

    from detent.selection_cli import main
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 100}
    facts = default_facts_for(cfg, device="cuda", dtype="bfloat16", max_context=8192, num_sms=132, arch="sm90",
                              triton=True, fa4=FA4)
    ff, out = tmp_path / "facts.json", tmp_path / "t.json"
    ff.write_text(json.dumps(facts))
    assert main(["tuple", "default", "--facts", str(ff), "--attention", "fa4", "-o", str(out)]) == 0
    t = CommitmentTuple.load(str(out))
    assert t.families["attention"]["knobs"] == {"impl": "fa4", "split_stride": 256, **KNOBS}
    assert main(["tuple", "check", str(out), "--facts", str(ff)]) == 0
    ff.write_text(json.dumps(dict(facts, fa4="")))
    assert main(["tuple", "default", "--facts", str(ff), "--attention", "fa4"]) == 1
    assert 'pip install "detent[fa4]"' in capsys.readouterr().err


@pytest.mark.parametrize("d,kvh", [(64, 2), (96, 8), (128, 8), (128, 32), (192, 4), (256, 8)])
def test_transcription_equals_fa4s_own_selection(monkeypatch, d, kvh):
    """Against flash-attn-4's own `_get_fwd_config` (its SM90 tile and, with
    num_splits=0, its split heuristic), where the package imports (it does on
    a CPU machine too, with nvidia-cutlass-dsl's cu13 libraries)."""
    fi = pytest.importorskip("flash_attn.cute.interface")
    import torch
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "132")
    s = sol(dict(GPU, fa4=FA4), dict(SITE, head_dim=d, num_kv_heads=kvh))
    sel = s.compile(dict(s.default_assignment(), impl="fa4"))
    knobs = tuple({"impl": "fa4", "split_stride": 256, **KNOBS}[k]
                  for k in s.vra.knob_names)
    gqa = 32 // kvh
    points = POINTS + [rt(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k) for b, q, k in
                       [(1, 1, 512), (1, 1, 640), (3, 1, 4096), (2, 17, 3000), (16, 1, 70000), (1, 2000, 2000),
                        (33, 1, 9000), (4, 5, 100000)]]
    for point in points:
        cfg = fi._get_fwd_config(arch=90, head_dim=d, head_dim_v=d, max_seqlen_q=point["max_seqlen_q"],
                                 max_seqlen_k=point["max_seqlen_k"], num_head_kv=kvh, qhead_per_kvhead=gqa,
                                 pack_gqa=gqa > 1, batch_size=point["num_seqs"], causal=True, local=False,
                                 window_size_left=None, window_size_right=None, num_splits=0,
                                 device=torch.device("cuda", 0))
        got = sel(**point)
        assert (got["tile_m"], got["tile_n"], got["mma_pv_is_rs"], got["intra_wg_overlap"], got["pack_gqa"]) == (
            cfg.m_block_size, cfg.n_block_size, cfg.mma_pv_is_rs, cfg.intra_wg_overlap, gqa > 1), point
        pins = dict(zip(s.pins, s.vra.values_at(tuple(point[n] for n in s.vra.inputs), knobs)))
        assert pins["num_splits"] == cfg.num_splits, point  # what FA4 would read from this batch


def test_cli_default_tuple_sets_any_knob(tmp_path, capsys):
    # --knob FAMILY.NAME=VALUE (repeatable): the Triton attention's exponent form and overlap, for
    # a serving arm or a benchmark; a value the program does not allow is refused with its choices
    import json

    from detent.selection_cli import main
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 100}
    facts = default_facts_for(cfg, device="cuda", dtype="bfloat16", max_context=8192, num_sms=132, arch="sm90",
                              triton=True)
    ff, out = tmp_path / "facts.json", tmp_path / "t.json"
    ff.write_text(json.dumps(facts))
    assert main(["tuple", "default", "--facts", str(ff), "--knob", "attention.softmax=exp",
                 "--knob", "attention.overlap_short=false", "--knob", "attention.tile_loop=auto",
                 "--knob", "attention.defer_rowsum=true", "-o", str(out)]) == 0
    t = CommitmentTuple.load(str(out))
    assert t.families["attention"]["knobs"] == {"impl": "triton_paged", "split_stride": 256, "softmax": "exp",
                                                "overlap_short": False, "tile_loop": "auto", "defer_rowsum": True}
    assert main(["tuple", "check", str(out), "--facts", str(ff)]) == 0
    capsys.readouterr()
    assert main(["tuple", "default", "--facts", str(ff), "--knob", "attention.softmax=exp3"]) == 1
    assert "knob 'softmax' = 'exp3' is not one of ['exp', 'exp2']" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="expected FAMILY.NAME=VALUE"):
        main(["tuple", "default", "--facts", str(ff), "--knob", "softmax"])

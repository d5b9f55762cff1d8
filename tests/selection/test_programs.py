"""The family programs: the selections the engine relies on, per mode, and the
ablations (constant folding only vs the full pipeline; pinning every
batch-dependent selection point vs the cut)."""
import pytest

from detent.selection import programs, solve
from tests.selection.conftest import ATTN_SITE, CPU, GEMM_SITE, GPU, MOE_SITE, rt


def sol(family, facts, site, **kw):
    return solve(programs.load(family), {**facts, **site}, **kw)


def test_gemm_cpu():
    s = sol("gemm", CPU, GEMM_SITE)
    # the chunk is a knob: nothing the batch (or the token budget) reaches moves it
    assert s.pins == () and s.knobs == {"chunk": ((1, 16), 16)}
    assert [a["chunk"] for a in s.legal] == [1, 16]
    stock, pinned, cons = (s.compile(mode=m) for m in ("stock", "pinned", "conservative"))
    for m in (0, 1, 3, 17, 8192):
        assert stock(num_tokens=m) == {"impl": "torch"}
        assert pinned(num_tokens=m) == {"impl": "torch_chunked", "chunk": 16}
        assert cons(num_tokens=m) == {"impl": "torch_chunked", "chunk": 1}
    assert s.compile({"chunk": 1})(num_tokens=3) == {"impl": "torch_chunked", "chunk": 1}
    small = sol("gemm", {**CPU, "max_num_batched_tokens": 8}, GEMM_SITE)
    assert small.default_assignment() == s.default_assignment() == {"chunk": 16}


def _fa3_split(num_seqs, max_q, max_k, kvh=3, gqa=3, num_sms=8, bm=16, bn=64):
    """FA3's num_splits_heuristic, written out independently for the CPU tile sizes."""
    m_blocks = -(-max_q * gqa // bm)
    n_blocks = -(-max_k // bn)
    total = num_seqs * kvh * m_blocks
    if total >= 0.8 * num_sms or n_blocks <= 4:
        return 1
    ms = min(128, num_sms, n_blocks)
    effs = [(total * s / num_sms) / -(-total * s // num_sms) for s in range(1, ms + 1)]
    return next(s for s, e in zip(range(1, ms + 1), effs) if e >= 0.85 * max(effs))


def test_attention_cpu_modes():
    s = sol("attention", CPU, ATTN_SITE)
    assert s.pins == ("split_tokens",)
    stock, pinned, cons = (s.compile(mode=m) for m in ("stock", "pinned", "conservative"))
    for b, q, k in [(1, 1, 900), (1, 1, 100), (2, 1, 3000), (1, 64, 64), (4, 1, 4096), (1, 1, 257)]:
        n = _fa3_split(b, q, k)
        want = {"impl": "sdpa"} if n == 1 else {
            "impl": "paged_split", "split_tokens": -(-(-(-k // n)) // 16) * 16, "q_chunk": 16}
        assert stock(**rt(num_tokens=b * q, num_seqs=b, max_seqlen_q=q, max_seqlen_k=k)) == want
        assert pinned(**rt(num_tokens=b * q, num_seqs=b, max_seqlen_q=q, max_seqlen_k=k)) == {
            "impl": "paged_split", "split_tokens": 256, "q_chunk": 16}
        assert cons(**rt(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k)) == {
            "impl": "paged_split", "split_tokens": 4096, "q_chunk": 16}
    assert stock(**rt(max_seqlen_k=900))["impl"] == "paged_split"  # the heuristic does split here


def test_moe_cpu_row_key():
    s = sol("moe", CPU, MOE_SITE)
    assert s.pins == ("row_key",)
    stock, pinned = s.compile(mode="stock"), s.compile(mode="pinned")
    keys = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
    for m in (0, 1, 5, 20, 100, 700, 5000):
        assert stock(num_tokens=m) == {"impl": "torch_loop", "row_key": min(keys, key=lambda x: abs(x - m))}
        assert pinned(num_tokens=m) == pinned(num_tokens=1)
    assert pinned(num_tokens=1)["impl"] == "torch_chunked"
    assert s.compile(mode="conservative")(num_tokens=7) == {"impl": "torch_chunked", "chunk": 1, "row_key": 1}


def test_allreduce_and_rowwise():
    ar = sol("allreduce", CPU, {"world_size": 2, "dtype": "float32"})
    assert ar.pins == ()
    assert ar.compile(mode="stock")(message_bytes=10) == {"impl": "native"}
    assert ar.compile(mode="pinned")(message_bytes=10) == {"impl": "ordered_gather"}
    g = sol("allreduce", GPU, {"world_size": 2, "dtype": "bfloat16"})
    assert g.pins == ("impl",)
    st = g.compile(mode="stock")
    assert st(message_bytes=1024) == {"impl": "one_shot"} and st(message_bytes=8 << 20) == {"impl": "two_shot"}
    pinned = g.compile(mode="pinned")
    assert pinned(message_bytes=1024) == pinned(message_bytes=8 << 20)
    for fam in ("norm", "rope", "act", "embedding", "logsoftmax"):
        s = sol(fam, CPU, {"dtype": "float32"})
        assert s.pins == () and s.graph.batch_dependent_points == ()
        assert s.compile()(num_tokens=3) == {"impl": "torch_rowwise"}
    assert sol("norm", GPU, {}).compile()() == {"impl": "triton_rowwise"}
    assert sol("norm", dict(GPU, triton=False), {}).compile()() == {"impl": "torch_rowwise"}
    assert sol("logsoftmax", GPU, {}).compile()() == {"impl": "triton_rowwise"}
    assert sol("embedding", GPU, {}).compile()() == {"impl": "torch_rowwise"}


def test_gpu_programs():
    a = sol("attention", GPU, dict(ATTN_SITE, num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"))
    # the query tile is declared neutral (MMA row sum); num_splits is the fa4 branch's (knob `impl`)
    assert a.pins == ("num_splits", "split_tokens")
    stock = a.compile(mode="stock")
    assert stock(**rt(num_seqs=1, max_seqlen_q=1, max_seqlen_k=8192)) == {
        "impl": "triton_paged", "split_tokens": 576, "block_m": 16, "block_n": 64, "num_warps": 4, "rowsum": "sum"}
    # against an independent plain-Python FA3 transcription (tests/selection/fa3_reference.py)
    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location("fa3_reference", pathlib.Path(__file__).with_name("fa3_reference.py"))
    dt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dt)
    for b, q, k in [(1, 1, 8192), (3, 1, 40000), (1, 7, 131072), (64, 1, 2048), (2, 300, 5000)]:
        n = dt.fa3_num_splits(b, 8, q, k, 4, 132)
        assert stock(**rt(num_seqs=b, max_seqlen_q=q, max_seqlen_k=k))["split_tokens"] == -(-(-(-k // n)) // 64) * 64
    pinned = a.compile(mode="pinned")
    d1, d2 = pinned(**rt(num_seqs=1, max_seqlen_k=100)), pinned(**rt(num_seqs=64, max_seqlen_q=500, max_seqlen_k=9000))
    assert d1["split_tokens"] == d2["split_tokens"] == 256 and d1["rowsum"] == d2["rowsum"] == "mma"
    assert (d1["block_m"], d2["block_m"]) == (16, 128)  # neutral: follows the query length
    assert pinned(**rt(num_seqs=2, max_seqlen_q=40, max_seqlen_k=900))["block_m"] == 64
    gm = sol("gemm", GPU, dict(GEMM_SITE, dtype="bfloat16"))
    assert gm.pins == () and gm.compile(mode="stock")(num_tokens=3) == {"impl": "torch"}
    p = gm.compile(mode="pinned")
    assert p(num_tokens=1) == {"impl": "triton_persistent", "block_m": 16, "block_n": 32, "block_k": 256,
                               "num_warps": 4, "num_stages": 5, "tma": 0}
    assert p(num_tokens=8192) == {"impl": "triton_persistent", "block_m": 128, "block_n": 64, "block_k": 128,
                                  "num_warps": 4, "num_stages": 4, "tma": 1}  # n = 576: the "tiny" column
    mo = sol("moe", GPU, MOE_SITE)
    # the fused kernel's rows are bit-identical on the H200 (tests/gpu): no pin, the row follows M
    assert mo.pins == ()
    for mode in ("stock", "pinned"):
        f = mo.compile(mode=mode)
        tiles = programs.moe_tiles()
        for n, key in ((1, 16), (100, 128), (600, 1024), (8000, 4096)):
            assert f(num_tokens=n) == {"impl": "triton_fused", **tiles[key], "fuse_glue": 2}, (mode, n)
    assert mo.compile(mode="conservative")(num_tokens=1) == {"impl": "triton_fused", **tiles[4096], "fuse_glue": 2}


def test_wave_split_cuts_where_a_round_of_the_sms_is_saved():
    # Llama-3.1-8B shapes: o_proj and down_proj (N = 4,096) at 1,152 rows are 144 wide tiles,
    # a second round for 12; the cut leaves 128 rows for one round of small tiles
    from detent.selection.programs import gemm as g

    def rounds(m, n):
        return -(-(-(-m // g.WIDE[0]) * -(-n // g.WIDE[1])) // g.SMS)

    assert g.wave_split(1152, 4096) == 1024 and g.wave_split(1280, 4096) == 1024
    assert g.wave_split(1024, 4096) == 1024  # one whole round: no cut
    assert g.wave_split(1344, 4096) == 1344  # 320 rows past the round: no cut
    assert g.wave_split(256, 4096) == 256  # small M: the table's own tiles
    assert g.wave_split(1152, 28672) == 1152  # wide outputs: the tail's tile is the wide one
    cuts = 0
    for n in (576, 2048, 4096, 5120, 6144, 14336):
        for m in range(257, 4097):
            head = g.wave_split(m, n)
            if head == m:
                continue
            cuts += 1
            tail = g.triton_config(m - head, n)
            assert head % g.WIDE[0] == 0 and 0 < m - head <= g.TAIL_MAX, (m, n)
            assert -(-(m - head) // tail[0]) * -(-n // tail[1]) <= g.SMS, (m, n)  # the rest: one round
            assert rounds(head, n) == rounds(m, n) - 1, (m, n)  # the head: one round fewer
    assert cuts > 0


def test_gpu_selections_match_the_registered_triton_candidates():
    pytest.importorskip("detent.kernels.gemm_triton")
    pytest.importorskip("detent.kernels.moe_triton")
    from detent.kernels import registry
    from detent.selection.programs import moe as moe_program
    assert moe_program.GPU_KEYS == tuple(programs.moe_tiles())
    for n in (128, 4096, 6144, 14336, 28672):
        g = sol("gemm", GPU, dict(GEMM_SITE, n=n, dtype="bfloat16")).compile(mode="pinned")
        for m in (1, 16, 17, 64, 65, 128, 200, 256, 257, 1152, 1280, 1281, 5000):
            sel = dict(g(num_tokens=m))
            want = programs.gemm_triton_params(m, n)  # the compiled selector vs Python
            assert sel.pop("impl") == "triton_persistent" and sel == want, (n, m)
    for fam, facts, site, r in [
            ("attention", GPU, dict(ATTN_SITE, num_heads=32, num_kv_heads=8, head_dim=128), rt(max_seqlen_k=900)),
            ("gemm", GPU, GEMM_SITE, rt()), ("moe", GPU, MOE_SITE, rt()),
            ("norm", GPU, {}, rt()), ("logsoftmax", GPU, {}, rt()),
            ("allreduce", GPU, {"world_size": 2, "dtype": "bfloat16"}, rt())]:
        s = sol(fam, facts, site)
        for mode in ("stock", "pinned", "conservative"):
            sel = dict(s.compile(mode=mode)(**r))
            cand = registry.candidates(fam).get(sel.pop("impl"))
            if cand is None:
                pytest.skip("Triton candidates are not registered on this machine")
            assert set(sel) <= set(cand.params), (fam, mode, sel, cand.params)


# ablations recorded: (pins with constant folding only, pins with the full pipeline,
#                      batch-dependent selection points = pins without the cut)
ABLATIONS = {
    ("gemm", "cpu"): (0, 0, 0), ("gemm", "gpu"): (0, 0, 0),  # CPU: the chunk is a knob
    ("attention", "cpu"): (1, 1, 1), ("attention", "gpu"): (2, 2, 2),  # GPU: split_tokens; fa4's num_splits
    ("moe", "cpu"): (1, 1, 1), ("moe", "gpu"): (0, 0, 0),
    ("allreduce", "cpu"): (0, 0, 0), ("allreduce", "gpu-small"): (1, 0, 0),
}


@pytest.mark.parametrize("family,dev", list(ABLATIONS))
def test_ablations(family, dev):
    facts = {"cpu": CPU, "gpu": GPU, "gpu-small": dict(GPU, hidden=576, max_num_batched_tokens=256)}[dev]
    site = {"gemm": GEMM_SITE, "attention": ATTN_SITE if dev == "cpu" else dict(
        ATTN_SITE, num_heads=32, num_kv_heads=8, head_dim=128), "moe": MOE_SITE,
        "allreduce": {"world_size": 2, "dtype": "bfloat16"}}[family]
    fold = sol(family, facts, site, level="fold", cache=False)
    full = sol(family, facts, site, level="full", cache=False)
    every = sol(family, facts, site, cut=False, cache=False)
    assert (len(fold.pins), len(full.pins), len(every.pins)) == ABLATIONS[(family, dev)]
    assert full.graph.nodes <= fold.graph.nodes


def test_every_program_family_is_one_ops_calls():
    """A family with a program but no `ops` call is dead code (a "sampling" family was)."""
    import ast
    import inspect

    from detent.selection import ops
    called = {n.args[0].value for n in ast.walk(ast.parse(inspect.getsource(ops)))
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "_resolve"}
    assert called == set(programs.FAMILIES)

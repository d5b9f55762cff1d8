"""make_dispatcher on SelIR: ops dispatch, per-step memoization, tuples, the CLI."""
import json

import pytest
import torch

from detent.selection.context import ForwardContext, forward_context
from detent.selection import TupleError, default_facts_for, default_tuple, make_dispatcher, ops
from detent.selection_cli import main
from detent.selection.dispatch import use_dispatcher
from detent.kernels import gemm as gemm_kernels  # tests may import kernels

CFG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
       "vocab_size": 100}
FACTS = default_facts_for(CFG, max_context=1024, max_num_batched_tokens=2048, max_num_seqs=32)
GEMM = (("n", 48), ("k", 64), ("dtype", "float32"))


def test_ops_linear_dispatches_the_pinned_candidate():
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    for mode, fn, kw in [("pinned", gemm_kernels.gemm_torch_chunked, {"chunk": 16}),
                         ("stock", gemm_kernels.gemm_torch, {}),
                         ("conservative", gemm_kernels.gemm_torch_chunked, {"chunk": 1})]:
        d = make_dispatcher(FACTS, mode)
        with use_dispatcher(d):
            got, params = d.resolve("gemm", GEMM, {"num_tokens": 5})
            assert got is fn and params == kw
            y = ops.linear(x, w)
        assert torch.equal(y, fn(x, w, None, **kw))


def test_selection_runs_once_per_forward_step_per_site():
    d = make_dispatcher(FACTS, "stock")
    calls = []
    inner = d.provider.selector

    def counting(family, site):
        sel = inner(family, site)
        return lambda **rt: calls.append(family) or sel(**rt)
    d.provider.selector = counting
    x, w = torch.randn(3, 64), torch.randn(48, 64)
    for _ in range(2):
        with forward_context(ForwardContext(attn=None, dispatcher=d)):
            for _layer in range(4):
                ops.linear(x, w)
    assert calls == ["gemm", "gemm"]


def test_ops_outside_a_step_context_name_the_missing_dispatcher():
    with pytest.raises(RuntimeError, match="no kernel dispatcher is active"):
        ops.linear(torch.randn(2, 64), torch.randn(48, 64))
    with forward_context(ForwardContext(attn=None)):  # a context without a dispatcher
        with pytest.raises(RuntimeError, match="no kernel dispatcher is active"):
            ops.linear(torch.randn(2, 64), torch.randn(48, 64))


def test_tuple_path_is_validated_at_startup(tmp_path):
    t = default_tuple(FACTS)
    p = tmp_path / "t.json"
    t.save(str(p))
    d = make_dispatcher(FACTS, "pinned", str(p))
    assert d.tuple.hash == t.hash
    with pytest.raises(TupleError, match="deployment fact 'max_num_seqs' differs"):
        make_dispatcher(dict(FACTS, max_num_seqs=64), "pinned", str(p))
    with pytest.raises(ValueError, match="only applies in selection mode 'pinned'"):
        make_dispatcher(FACTS, "stock", str(p))
    with pytest.raises(ValueError, match="selection mode must be one of"):
        make_dispatcher(FACTS, "fast")


def test_pinned_ignores_the_batch_and_stock_does_not():
    site = (("num_heads", 4), ("num_kv_heads", 2), ("head_dim", 16), ("block_size", 16), ("dtype", "float32"))
    pinned, stock = make_dispatcher(FACTS, "pinned"), make_dispatcher(FACTS, "stock")
    batches = [dict(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=k, total_kv=k) for k in (10, 700, 1024)]
    assert len({repr(pinned.select("attention", site, b)) for b in batches}) == 1
    assert len({repr(stock.select("attention", site, b)) for b in batches}) > 1


def test_cli_solve_and_tuple(tmp_path, capsys):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(FACTS))
    assert main(["solve", "--family", "attention", "--facts", str(facts)]) == 0
    out = capsys.readouterr().out
    assert "pins (1): split_tokens" in out and "legal" in out and "batch-dependent: split_tokens" in out
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(dict(CFG, max_position_embeddings=1024)))
    t = tmp_path / "t.json"
    assert main(["tuple", "default", "--model", str(cfg), "-o", str(t)]) == 0
    assert main(["tuple", "check", str(t), "--model", str(cfg)]) == 0
    assert main(["tuple", "check", str(t), "--model", str(cfg), "--max-num-seqs", "8"]) == 1
    assert "deployment fact 'max_num_seqs' differs" in capsys.readouterr().err


def test_cli_reads_the_embedded_gguf(capsys):
    assert main(["solve", "--family", "gemm", "--model", "embedded", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "site dtype=float32,k=576,n=960" in out and "site dtype=float32,k=576,n=3072" in out and "pins (0)" in out and "2 legal" in out


def test_cli_takes_a_preset_name(tmp_path, capsys):
    t = tmp_path / "t.json"
    assert main(["tuple", "default", "--model", "llama-3.1-8b", "--device", "cuda", "--dtype", "bfloat16",
                 "-o", str(t)]) == 0
    facts = json.loads(t.read_text())["deployment"]["facts"]
    assert (facts["hidden"], facts["num_kv_heads"], facts["device"]) == (4096, 8, "cuda")


def test_family_override_replaces_or_extends_one_family():
    from detent.selection.dispatch import Dispatcher
    from detent.selection.provider import FamilyOverride
    base = make_dispatcher(FACTS, "pinned")
    rt = {"num_tokens": 5}
    want = base.select("gemm", GEMM, rt)
    extended = Dispatcher(FamilyOverride(base.provider, "gemm", extra={"chunk": 4}))
    assert extended.select("gemm", GEMM, rt) == {**want, "chunk": 4}
    fixed = Dispatcher(FamilyOverride(base.provider, "gemm", {"impl": "torch"}))
    assert fixed.select("gemm", GEMM, rt) == {"impl": "torch"}
    other = (("dim", 64), ("dtype", "float32"))
    assert fixed.select("norm", other, rt) == base.select("norm", other, rt)  # the other families as deployed
    with pytest.raises(ValueError, match="exactly one"):
        FamilyOverride(base.provider, "gemm", {"impl": "torch"}, extra={"chunk": 4})
    with pytest.raises(ValueError, match="exactly one"):
        FamilyOverride(base.provider, "gemm")

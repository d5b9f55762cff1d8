"""Decode through CUDA graphs gives the same bits as eager decode."""
import pytest
import torch

from detent.engine.cuda_graph import CudaGraphRunner
from detent.selection.context import AttentionMetadata, ForwardContext, forward_context
from detent.models.config import ModelConfig
from detent.models.loader import load_model
from detent.selection import make_dispatcher
from detent.selection.facts import default_facts_for

pytestmark = pytest.mark.gpu
BS = 16
CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
       "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
       "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
       "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


def _meta(tables, chunks, dev):
    qsl, lens, slots = [0], [], []
    for tab, (s, e) in zip(tables, chunks):
        qsl.append(qsl[-1] + e - s)
        lens.append(e)
        slots += [tab[p // BS] * BS + p % BS for p in range(s, e)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev), num_seqs=len(chunks),
        num_tokens=qsl[-1], max_seqlen_q=max(e - s for s, e in chunks), max_seqlen_k=max(lens),
        block_size=BS, query_start_loc_cpu=tuple(qsl), seq_lens_cpu=tuple(lens))


def tiny_mixed_steps(arch: str, knobs: dict | None = None):
    """A tiny Llama or Qwen3 on the GPU, pinned, three sequences' tables and token ids, and
    `run(chunks, graphs=None)`: the step whose sequence b contributes tokens [s_b, e_b), run
    eagerly or through a graph runner's `run` (None when that runner takes no such step);
    `no_sync=True` makes any device synchronization inside that `run` raise. `knobs`: the
    default tuple with these knobs (e.g. {"attention": {"impl": "fa4"}})."""
    dev = torch.device("cuda")
    hf = dict(CFG)
    if arch == "qwen3":
        hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    cfg = ModelConfig.from_hf(hf)
    model = load_model(cfg, device=dev, dtype=torch.bfloat16, load_format="dummy", progress=False)
    caches = [torch.zeros(2, 40, BS, 2, 64, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    facts = default_facts_for(cfg, device="cuda", dtype="bfloat16", tp=1, page_size=BS, max_context=512)
    path = None
    if knobs:
        import tempfile

        from detent.selection import default_tuple
        path = tempfile.mkstemp(suffix=".json", prefix="detent-tuple-")[1]
        default_tuple(facts, knobs=knobs).save(path)
    disp = make_dispatcher(facts, "pinned", path)
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ids = [torch.randint(3, 1000, (n + 1,), device=dev) for n in (40, 17, 60)]

    def run(chunks, graphs=None, no_sync=False):
        meta = _meta(tables, chunks, dev)
        tok = torch.cat([ids[b][s:e] for b, (s, e) in enumerate(chunks)])
        pos = torch.cat([torch.arange(s, e, device=dev) for s, e in chunks])
        ctx = ForwardContext(attn=meta, kv_caches=caches, dispatcher=disp)
        with forward_context(ctx):
            if graphs is None:
                out = model(tok, pos)
            else:  # no_sync: the graph runner's host side must not wait for the device
                before = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error" if no_sync else before)
                try:
                    out = graphs.run(tok, pos, ctx)
                finally:
                    torch.cuda.set_sync_debug_mode(before)
        return None if out is None else out.clone()
    return cfg, model, caches, disp, run


def test_graph_replay_matches_eager():
    mode = "pinned"
    dev = torch.device("cuda")
    cfg = ModelConfig.from_hf(CFG)
    model = load_model(cfg, device=dev, dtype=torch.bfloat16, load_format="dummy", progress=False)
    caches = [torch.zeros(2, 40, BS, 2, 64, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    facts = default_facts_for(cfg, device="cuda", dtype="bfloat16", tp=1, page_size=BS, max_context=512)
    disp = make_dispatcher(facts, mode, None)
    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    lens = [40, 17, 60]
    ids = [torch.randint(3, 1000, (n + 1,), device=dev) for n in lens]

    def run(chunks, eager=True, graphs=None):
        meta = _meta(tables, chunks, dev)
        tok = torch.cat([ids[b][s:e] for b, (s, e) in enumerate(chunks)])
        pos = torch.cat([torch.arange(s, e, device=dev) for s, e in chunks])
        with forward_context(ForwardContext(attn=meta, kv_caches=caches, dispatcher=disp)):
            if eager:
                return model(tok, pos)
            return graphs.run(tok, pos, meta)

    with torch.inference_mode():
        run([(0, n) for n in lens])  # prefill
        graphs = CudaGraphRunner(model, caches, BS, disp, dev, max_model_len=512, capture_sizes=[1, 4]).capture()
        assert graphs.disabled is None, graphs.disabled
        dec = [(n, n + 1) for n in lens]
        eager = run(dec).clone()
        replay = run(dec, eager=False, graphs=graphs).clone()
        assert graphs.size_for(_meta(tables, dec, dev)) == 4  # 3 sequences padded to 4
        assert torch.equal(replay, eager)
        # a second replay with other tokens reuses the static buffers correctly
        for b, n in enumerate(lens):
            ids[b][n] = (ids[b][n] + 7) % 1000
        assert torch.equal(run(dec, eager=False, graphs=graphs), run(dec))

"""A step's host -> device copy is one packed buffer cut into views. Triton
specializes a kernel on whether each pointer argument is 16-byte aligned, so a
view whose alignment followed the step's token count (the positions after an
odd count of int64 token ids) made the rope kernel compile a variant the warm
start had not run (seen on the H200 in an eager 16-sequence step, lease 19).

Contract: every view a step hands to the model starts 16-byte aligned,
whatever its token count. Comparator: `data_ptr() % 16 == 0`.
"""
from __future__ import annotations

from detent.engine import SamplingParams
from engine_helpers import bundle, make_llm, prompt


def test_every_view_of_a_step_is_16_byte_aligned_for_odd_and_even_token_counts(monkeypatch):
    llm = make_llm(bundle("llama"), async_scheduling=False)
    runner = llm.llm_engine.runner
    real, seen = runner.prepare, []

    def prepare(plan, prev=None):
        b = real(plan, prev)
        views = {"input_ids": b.input_ids, "positions": b.positions, "slot_mapping": b.attn.slot_mapping,
                 "sample_rows": b.sample_rows, "prompt_rows": b.prompt_rows}
        seen.append((b.attn.num_tokens, {k: v.data_ptr() % 16 for k, v in views.items() if v.numel()}))
        return b
    monkeypatch.setattr(runner, "prepare", prepare)
    prompts = [{"prompt_token_ids": prompt(i, n, 160)} for i, n in enumerate((7, 8, 5))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    llm.generate(prompts, params, use_tqdm=False)
    counts = {t for t, _ in seen}
    assert any(t % 2 for t in counts) and any(t % 2 == 0 for t in counts), counts
    assert all(off == 0 for _, offs in seen for off in offs.values()), seen

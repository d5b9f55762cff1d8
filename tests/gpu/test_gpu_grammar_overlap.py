"""Grammar requests under async scheduling on the GPU (bf16, Triton candidates, CUDA graphs):
a grammar row's step is launched with its sampling deferred until the previous step's
token has advanced the grammar (ModelRunner.sample_deferred). Every request's tokens ==
and chosen/top-2 logprobs torch.equal the serial run's, the outputs validate, and the
deferred sampling never waits for the device (torch.cuda's sync debug mode "error")."""
import os
import sys

import pytest
import torch

from detent.engine import LLM, SamplingParams
from detent.models import load_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sampling.engine_util import CharTokenizer, result_of, same, tiny_config  # noqa: E402
from sampling.test_engine_grammar import VOCAB, _mixed_grammar_requests, assert_valid, run  # noqa: E402

pytestmark = pytest.mark.gpu


def _llm(async_scheduling: bool) -> LLM:
    mc = tiny_config(VOCAB)
    model = load_model(mc, device="cuda", dtype=torch.bfloat16, load_format="dummy", seed=0)
    with torch.no_grad():  # dummy logits are nearly flat: sharpen them so the grammar's choices matter
        model.lm_head.weight.mul_(12.0)
    return LLM.from_model(model, mc, CharTokenizer(VOCAB), device="cuda", selection="pinned",
                          async_scheduling=async_scheduling, max_model_len=256, max_num_seqs=8,
                          max_num_batched_tokens=512, kv_cache_memory_bytes=1 << 26)


def test_grammar_requests_overlap_on_the_gpu_and_equal_serial():
    reqs = _mixed_grammar_requests()
    serial = run(_llm(False), reqs)
    llm = _llm(True)
    runner = llm.llm_engine.runner
    real, calls = runner.sample_deferred, []

    def no_wait(handle, live):  # the deferred sampling queues its work without reading the device
        torch.cuda.set_sync_debug_mode("error")
        try:
            real(handle, live)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        calls.append(1)
    runner.sample_deferred = no_wait
    got = run(llm, reqs)
    assert_valid([r for r in got if r[0] != "plain"])
    assert all(same(result_of(a), result_of(b)) for (_, a), (_, b) in zip(got, serial))
    assert len(calls) >= 20, len(calls)


def test_prompt_logprobs_overlap_on_the_gpu_and_equal_serial():
    """Steps with prompt-logprob rows are launched without waiting for the device (the rows
    come back in collect), and every output equals the serial run's."""
    prompts = [[(7 * i + 3 * k) % (VOCAB - 3) + 2 for k in range(40 + 60 * i)] for i in range(4)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, logprobs=2, prompt_logprobs=3, ignore_eos=True)
              for i in range(4)]

    def outputs(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [sorted((t, lp.logprob) for t, lp in d.items())
                                                for d in o.prompt_logprobs[1:]]) for o in outs]
    serial = outputs(_llm(False))
    llm = _llm(True)
    runner = llm.llm_engine.runner
    real, with_rows = runner.launch, []

    def launch(plan, prev=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = real(plan, prev)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        with_rows.append(any(s.prompt_targets for s in plan.seqs))
        return handle
    runner.launch = launch
    assert outputs(llm) == serial
    assert sum(with_rows) >= 2

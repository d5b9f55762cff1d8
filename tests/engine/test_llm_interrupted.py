"""An offline call whose step loop raises (an engine error) or is interrupted (Ctrl-C)
takes its unfinished requests back before the exception leaves it, as vLLM's LLM aborts
them: none runs on unseen into the next call's steps, and update_weights is not refused
as busy. The next call's outputs equal those of an engine that never saw the first."""
from __future__ import annotations

import pytest

from detent.engine import SamplingParams
from engine_helpers import failing_launch, text_llm

SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3, 4, 5, 6]}, {"prompt_token_ids": [9, 8, 7]}]


def _raise_after_first_step(monkeypatch, eng, exc):
    real = eng.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] > 1:
            raise exc
        return real()

    monkeypatch.setattr(eng, "step", step)


def _assert_clean_and_usable(llm, want):
    """Nothing left in the engine; update_weights and a new generate work, the latter
    with its own steps only and the outputs of an undisturbed engine."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert not eng.scheduler.requests and not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.stats()["num_waiting"] == 0 and not eng.outputs.groups
    norm = eng.runner.model.model.norm.weight
    assert llm.update_weights({"model.norm.weight": norm.detach().clone()}) == 1
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.fixture(scope="module")
def want():
    return [list(o.outputs[0].token_ids) for o in text_llm().generate(PROMPTS, SP, use_tqdm=False)]


@pytest.mark.parametrize("exc", [RuntimeError("engine error"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_generate_whose_step_raises_takes_its_requests_back(monkeypatch, want, exc, overlap):
    llm = text_llm(async_scheduling=overlap)
    eng = llm.llm_engine
    with monkeypatch.context() as m:
        _raise_after_first_step(m, eng, exc)
        with pytest.raises(type(exc)):
            llm.generate(PROMPTS, SP, use_tqdm=False)
    steps = eng.stats()["num_steps"]
    _assert_clean_and_usable(llm, want)
    if not overlap:
        assert eng.stats()["num_steps"] - steps == SP.max_tokens  # no leftover request's steps


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_an_engine_error_inside_a_step_takes_the_batch_back(monkeypatch, want, overlap):
    """The runner fails at the second launch with an error no request caused: the step
    re-raises it (its plan retracted), and generate withdraws the batch."""
    llm = text_llm(async_scheduling=overlap)
    eng = llm.llm_engine
    with monkeypatch.context() as m:
        m.setattr(eng.runner, "launch", failing_launch(eng.runner, 2, RuntimeError("device lost")))
        with pytest.raises(RuntimeError, match="device lost"):
            llm.generate(PROMPTS, SP, use_tqdm=False)
    _assert_clean_and_usable(llm, want)


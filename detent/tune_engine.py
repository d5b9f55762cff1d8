"""The tuner's hands on a loaded engine (docs/tune.md): install a commitment
tuple without reloading the model, record the dispatcher's calls, and replay
a workload offline.

A tuple is installed by writing it to a file and building the engine's
dispatcher from it with `make_dispatcher` — the same loader `detent-serve
--tuple` runs, so an illegal tuple raises `TupleError` here too — then
recapturing the CUDA graphs (they hold the old selections) and running the
warm start (engine/warmup.py), as startup does. Under tensor
parallelism every rank does the same (`collective_rpc`); rank 0's calls are
the profile (all ranks select alike).
"""
from __future__ import annotations

import os
import time
from typing import Any

from detent.selection import CommitmentTuple, make_dispatcher
from detent.selection.facts import complete


def engine_facts(llm) -> dict[str, Any]:
    """The deployment facts the engine's tuples are made for."""
    return complete(llm.llm_engine.facts)


class GraphCaptureError(RuntimeError):
    """A candidate's CUDA graphs did not capture where the default tuple's did: its steps would
    run eagerly, and their time is not comparable with the default's."""


def _install_local(runner, config, max_model_len: int, facts: dict, path: str | None,
                   record: bool) -> dict[str, str]:
    """Install the tuple at `path`; the graph sets that failed to capture, with why."""
    d = make_dispatcher(facts, "pinned", path)
    d.record_calls = record
    runner.dispatcher = d
    if record:  # graphs would replay without asking the dispatcher: profile eagerly
        eager = getattr(runner, "_eager_forward", None)
        if eager is not None:
            runner._forward = eager
        return {}
    from detent.engine.graphs import enable_graphs, graph_failures
    from detent.engine.startup import warm_start
    enable_graphs(runner, config, max_model_len=max_model_len)
    # the new selections' kernels compile here, not inside the measurement (on CUDA, as at startup)
    warm_start(runner, config, facts, max_model_len, world=config.tensor_parallel_size, progress=False)
    return graph_failures(runner)


def _rank_install(st, config, path: str | None, record: bool) -> dict[str, str]:
    """On every tensor-parallel rank (collective_rpc)."""
    return _install_local(st.runner, config, st.info.max_model_len, complete(st.info.facts), path, record)


def _rank_calls(st) -> dict:
    return dict(st.runner.dispatcher.calls)


class TupleInstaller:
    """Installs tuples on one engine; files go to `workdir`."""

    def __init__(self, llm, workdir: str):
        self.llm, self.workdir = llm, workdir
        self.facts = engine_facts(llm)
        self.current: str | None = None  # hash of the installed tuple (and whether recording)
        self._n = 0
        self.base_failures: dict[str, str] | None = None  # graph sets the first measured tuple lacked

    def install(self, t: CommitmentTuple, record: bool = False) -> None:
        key = f"{t.hash}:{record}"
        if key == self.current:
            return
        self._n += 1
        path = os.path.join(self.workdir, f"candidate-{self._n}.json")
        t.save(path)
        eng = self.llm.llm_engine
        if eng.dispatcher is None:  # tensor parallel: the ranks hold the dispatchers
            failed: dict[str, str] = {}
            for rank in eng.runner.collective_rpc(_rank_install, eng.config, path, record):
                failed.update(rank or {})
        else:
            failed = _install_local(eng.runner, eng.config, eng.state.max_model_len, self.facts, path, record)
            eng.dispatcher = eng.runner.dispatcher
        self.current = key
        if record:
            return
        if self.base_failures is None:  # the first tuple measured: the default
            self.base_failures = failed
        lost = {k: v for k, v in failed.items() if k not in self.base_failures}
        if lost:
            self.current = None
            raise GraphCaptureError(
                f"detent tune: candidate {t.hash[:16]}'s CUDA graphs did not capture where the default "
                f"tuple's did, so its steps would run eagerly and its time would not compare: "
                + "; ".join(f"{k}: {v}" for k, v in sorted(lost.items()))
                + ". Leave more GPU memory outside the KV cache (--gpu-memory-utilization) or use "
                  "--cost kernels (no graphs).")

    def calls(self) -> dict:
        """(family, site, runtime) -> count, as the installed dispatcher recorded them."""
        eng = self.llm.llm_engine
        if eng.dispatcher is None:
            return eng.runner.collective_rpc(_rank_calls)[0]
        return dict(eng.dispatcher.calls)


def run_offline(llm, workload, max_tokens_cap: int | None = None) -> tuple[float, int]:
    """Replay `workload` through the engine (each round of chat turns after the
    one before, so later turns hit the prefix cache); (wall seconds, output tokens)."""
    from detent.engine import SamplingParams

    llm.reset_prefix_cache()
    t0, tokens = time.perf_counter(), 0
    for idx in workload.rounds():
        reqs = [workload.requests[i] for i in idx]
        params = [SamplingParams(temperature=0, ignore_eos=True,
                                 max_tokens=min(r.max_tokens, max_tokens_cap or r.max_tokens)) for r in reqs]
        outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - t0, tokens

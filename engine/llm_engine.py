"""`LLMEngine`: the engine core loop.

    step():  plan = scheduler.schedule()          # which tokens, which blocks
             h    = runner.launch(plan, prev)      # queue forward + sampling on the device
             out  = runner.collect(prev)           # wait for the previous step's tokens
             done = scheduler.update(prev, out)    # stop checks, free blocks, outputs
             prev = h

With `async_scheduling` (on by default on CUDA) the host plans and
launches step N+1 before it waits for step N, so scheduling, input
preparation and output processing run while the device computes (vLLM's
async scheduling). Step N+1's rows then take the tokens step N sampled
straight from the device (`PLACEHOLDER` inputs); a request that finishes at
step N has one extra row in step N+1, whose token is dropped. The tokens,
logprobs and their bits are the same as without overlap: every row is
computed from the same inputs, and the extra rows are neighbours, which a
batch-invariant step does not see. Rows that read their output so far
(penalties, min_tokens, bad words, golden tokens) take its pending last
token from the device (`SamplingRow.pending`: it is the row's last input
token). A grammar request needs its token on the host before its next
token can be sampled (its grammar advances on it): its step is launched with
the forward queued and the sampling deferred, and sampled right after step
N's tokens have advanced the grammars (`ModelRunner.sample_deferred`), while
the forward runs. Prompt logprobs stay on the device until their step is
collected, and a prompt's next chunk is planned after the rows already
planned. The engine collects first (no overlap) only for a grammar request
under a runner that cannot defer its sampling (tensor parallelism):
`Request.needs_token_feedback`.
Without `async_scheduling` each step launches and collects its own plan.

Threading: `add_request` and `abort_request` may be called from any thread
(e.g. a server's event loop) while another thread runs `step()`. They
validate at once (raising on bad input) and queue the change in an inbox
that `step()` drains at its start, so they never wait for a forward pass.
`step()` itself must be called from one thread at a time (a lock enforces
it). `has_unfinished_requests()` and `stats()` are safe from any thread.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from typing import Any, Sequence

import torch

from detent.engine.admission import admitted_prompt
from detent.engine.config import EngineConfig, EngineLimits
from detent.engine.fingerprint import Fingerprint, fingerprint
from detent.engine.isolation import find_culprits
from detent.engine.output_processor import OutputProcessor
from detent.engine.outputs import RequestOutput
from detent.engine.profiler import StepProfiler
from detent.engine.startup import build_runner, freeze_gc_heap
from detent.engine.step_stats import HOST_PARTS, KIND_HOST_PARTS, StepStats, step_kind
from detent.sampling.params import SamplingParams
from detent.sampling.processors import RequestMaskIds, checked_for
from detent.scheduler.block_hash import HashedPrompt
from detent.scheduler.request import Request, RequestStatus
from detent.scheduler.scheduler import Scheduler, SchedulerLimits


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model: torch.nn.Module | None = None,
                 model_config: Any = None, tokenizer: Any = None):
        """Load `config.model` (or use the given `model` + `model_config`,
        e.g. in tests), size the KV cache, install the kernel dispatcher."""
        self.config = config
        if config.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("tensor_parallel_size > 1 loads the model in each rank: pass model=NAME, "
                                 "not a built module")
            from detent.engine.tp import start_tp
            tp = start_tp(config)  # spawns the ranks; each builds its own ModelRunner
            model_config, tokenizer, self.state, self.facts = tp.model_config, tp.tokenizer, tp.state, tp.facts
            self.dispatcher = None
            self.runner = tp.executor  # launch(plan, prev) / collect(handle) / execute(plan), shutdown()
        else:
            device = config.resolve_device()
            if model is None:
                from detent.engine.loader import load
                model, model_config, tokenizer = load(config, device)
            self._build_local(model, model_config, device)
        self.model_config, self.tokenizer = model_config, tokenizer
        self.outputs = OutputProcessor(tokenizer)
        self.scheduler = Scheduler(SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.state.max_model_len, config.max_mixed_batched_tokens,
                                                   config.mixed_token_align),
                                   self.state.num_blocks, config.block_size, config.enable_prefix_caching,
                                   stop_strings=self.outputs.update_text,
                                   grammar_after_launch=getattr(self.runner, "samples_after_launch", False))
        self.block_manager = self.scheduler.bm  # read-only view for stats()
        eos = set(getattr(model_config, "eos_token_ids", ()) or ())
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self._seed_rng = random.Random(config.seed)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._inbox_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._pending_ids: set[str] = set()  # added, not yet drained
        self._live_ids: set[str] = set()  # drained, not yet finished
        self._num_steps = 0
        self.step_stats = StepStats()  # stats()["steps_by_kind"]
        # the host parts the step kinds do not already count (launch and wait are theirs: host_time)
        self.host_seconds = dict.fromkeys((p for p in HOST_PARTS if p not in KIND_HOST_PARTS), 0.0)
        self._inflight = None  # the launched step not yet collected (async scheduling)
        self.profiler = None  # engine/profiler.py StepProfiler, made by the first /start_profile
        self.async_scheduling = (self.state.device.type == "cuda" if config.async_scheduling is None
                                 else bool(config.async_scheduling))
        self._grammars = None  # GrammarCompilerCache, made on the first structured_outputs request
        self._grammars_lock = threading.Lock()
        self.gc_frozen = freeze_gc_heap(config, self.state.device)

    def _build_local(self, model: torch.nn.Module, mc: Any, device: torch.device) -> None:
        """The tp = 1 rank: the same recipe every tensor-parallel rank runs (engine/startup.py)."""
        rt = build_runner(self.config, model, mc, device)
        self.state, self.facts, self.dispatcher, self.runner = rt.state, rt.facts, rt.dispatcher, rt.runner

    def shutdown(self) -> None:
        """Stop tensor-parallel ranks and grammar workers (if any). Idempotent."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        if self._grammars is not None:
            self._grammars.shutdown()

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, prompt: str | None = None) -> None:
        """Queue a request. Raises ValueError on bad input (naming the field). A `HashedPrompt`
        (detent-serve's) brings its blocks' hashes: its requests take them (Request's prompt_hashes)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        ids = admitted_prompt(request_id, prompt_token_ids, params, vocab=self.model_config.vocab_size,
                              max_model_len=self.state.max_model_len, max_logprobs=self.config.max_logprobs,
                              rl=self.config.rl, tokenizer=self.tokenizer)
        hashed = prompt_token_ids if isinstance(prompt_token_ids, HashedPrompt) else None
        masks = self._mask_ids(params)
        masks.check_some_token_left(self.model_config.vocab_size)
        # the grammar compile is submitted here, not when step() drains the inbox (as vLLM's
        # EngineCore.add_request): a full compile lane refuses the request to its caller
        # (CompileQueueFull), and the compile starts before the next step
        grammars = self._new_grammars(params)
        try:
            with self._inbox_lock:
                if request_id in self._pending_ids or request_id in self._live_ids:
                    raise ValueError(f"request_id {request_id!r} is already in use")
                self._pending_ids.add(request_id)
                seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
                self._inbox.append(("add", (request_id, ids, params, prompt, seed, grammars, masks, hashed)))
        except BaseException:
            for g in grammars:
                g.release()
            raise

    def _mask_ids(self, params: SamplingParams) -> RequestMaskIds:
        """The request's mask tables, built here rather than at its first masked step, where
        100k bad words took 180 ms to index and stalled every request of that step. Under
        tensor parallelism the ranks sample, and build their own (they travel without tables);
        this process's serve the admission check and the scheduler's (`leaves_out`)."""
        return RequestMaskIds(params, self.eos_token_ids).build(self.model_config.vocab_size)

    def _new_grammars(self, params: SamplingParams) -> list:
        """One grammar state per sample of a structured request (the compile shared), or none."""
        if params.structured_outputs is None:
            return []
        cache = self._grammar_cache()
        # a spec checked_params checked (under the default limits, the cache's) or the first sample's
        # is not walked again; its key, checked_params' or made here, serves every sample
        checked = checked_for(params, self.model_config.vocab_size)
        spec = params.structured_outputs
        key = checked.spec_key if checked is not None else spec.key()
        states = []
        try:
            for _ in range(params.n):
                states.append(cache.new_state(spec, checked=checked is not None or bool(states), key=key))
        except BaseException:
            for g in states:
                g.release()
            raise
        return states

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._inbox_lock:
            for rid in ids:
                self._inbox.append(("abort", rid))

    def withdraw_requests(self, request_ids: Sequence[str]) -> None:
        """Take back requests whose caller gave up on them (`LLM.generate` when a later prompt
        of its batch is refused, or when its step loop raised or was interrupted): they leave
        at once, with no output (so `has_unfinished_requests()` and `update_weights` see them
        gone): those still queued leave the inbox; those a step took in are aborted here,
        between steps (waiting for one running in another thread)."""
        ids = set(request_ids)
        if not ids:
            return
        with self._step_lock:
            with self._inbox_lock:
                kept: deque[tuple[str, Any]] = deque()
                for kind, payload in self._inbox:
                    if kind == "add" and payload[0] in ids:
                        self._pending_ids.discard(payload[0])
                        for g in payload[5]:  # their grammar states
                            g.release()
                        ids.discard(payload[0])
                    else:
                        kept.append((kind, payload))
                self._inbox = kept
            for rid in sorted(ids):
                self._abort_group(rid)  # its output dropped: nobody waits for it

    def has_unfinished_requests(self) -> bool:
        with self._inbox_lock:
            return bool(self._pending_ids or self._live_ids)

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._inbox_lock:
            items, self._inbox = list(self._inbox), deque()
        aborted_outputs = []
        for kind, payload in items:
            if kind == "add":
                rid, ids, params, prompt, seed, grammars, masks, hashed = payload
                n = params.n
                children: list[Request] = []
                for i in range(n):  # the first sample hashes the prompt's blocks (or takes them), for every sample
                    children.append(Request(rid if n == 1 else f"{rid}#{i}", ids, params, seed=seed,
                                            block_size=self.config.block_size, sample_index=i,
                                            eos_token_ids=self.eos_token_ids, mask_ids=masks,
                                            sibling=children[0] if children else None, prompt_hashes=hashed))
                for c, g in zip(children, grammars):  # compiling off the step loop since add_request
                    c.grammar = g
                self.outputs.add(rid, prompt, children)
                for c in children:
                    self.scheduler.add(c)
                with self._inbox_lock:
                    self._pending_ids.discard(rid)
                    self._live_ids.add(rid)
            elif (out := self._abort_group(payload)) is not None:
                aborted_outputs.append(out)
        return aborted_outputs

    def _abort_group(self, group_id: str) -> RequestOutput | None:
        """Abort a drained request's unfinished samples; its last output (None: not live)."""
        children = self.outputs.children(group_id)
        for c in children:
            if not c.is_finished:
                self.scheduler.abort(c.request_id)
        return self._emit(group_id) if children else None

    def _grammar_cache(self):
        with self._grammars_lock:  # add_request may run in several threads
            if self._grammars is None:
                from detent.sampling.grammar import GrammarCompilerCache
                from detent.sampling.grammar_limits import GrammarLimits
                self._grammars = GrammarCompilerCache(
                    self.tokenizer, self.model_config.vocab_size, stop_token_ids=self.eos_token_ids,
                    limits=GrammarLimits(max_queued_compiles=self.config.max_queued_grammar_compiles))
            return self._grammars

    def _emit(self, group_id: str) -> RequestOutput:
        out = self.outputs.make_output(group_id)
        if out.finished:
            self.outputs.release(group_id)
            with self._inbox_lock:
                self._live_ids.discard(group_id)
        return out

    # ------------------------------------------------------------ the loop
    def start_profile(self, cfg) -> dict:
        """Arm a torch profiler window over the next steps (engine/profiler.py); between steps."""
        with self._step_lock:
            if self.profiler is None:
                self.profiler = StepProfiler(cfg, self.state.device.type)
            return {"started": self.profiler.start(), "delay_iterations": cfg.delay_iterations,
                    "max_iterations": cfg.max_iterations}

    def stop_profile(self) -> dict:
        """End the window (its trace written); every trace written so far."""
        with self._step_lock:
            if self.profiler is None:
                return {"trace": None, "traces": []}
            path = self.profiler.stop()
            return {"trace": path, "traces": list(self.profiler.traces)}

    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step; outputs (cumulative) of the
        requests that got a token or finished, `finished` set on the last.
        With async scheduling the tokens returned are those of the step
        launched by the previous call."""
        with self._step_lock:
            host = self.host_seconds
            t0 = time.perf_counter()
            results = self._drain_inbox()
            failed = {self.outputs.parent_of[r.request_id]: None for r in self.scheduler.fail_grammar_errors()}
            results += [self._emit(g) for g in failed]
            t1 = time.perf_counter()
            host["inbox"] += t1 - t0
            prev, self._inflight = self._inflight, None
            if prev is not None and self._needs_tokens_first(prev):
                results += self._finish_step(prev)
                prev = None
            t1 = time.perf_counter()
            plan = self.scheduler.schedule()
            host["schedule"] += time.perf_counter() - t1
            handle, prev = self._launch(plan, prev, results)
            groups = self._advance(prev) if prev is not None else {}
            # a step whose sampling waits for prev's tokens (grammar rows) is sampled now that they
            # have advanced the grammars, while its forward runs, before the outputs are built
            error = self._sample_deferred(handle) if handle is not None else None
            results += self._emit_all(groups)
            if error is not None:
                self.step_stats.drop(handle)
                results += self._undo(handle.plan, error)
                handle = None
            if handle is not None:
                if self.async_scheduling:
                    self._inflight = handle
                else:
                    results += self._finish_step(handle)
            if self.profiler is not None:
                self.profiler.on_step()
            return results

    def stalled(self, outputs: list[RequestOutput]) -> bool:
        """After a step that returned `outputs`: whether it returned nothing with nothing running
        (only requests waiting on a grammar compile), so that a loop over step() waits a little
        instead of spinning (which also takes the GIL from the compile's thread)."""
        return not outputs and not self.scheduler.running

    def pause_if_idle(self, outputs: list[RequestOutput]) -> None:
        """Sleep 1 ms after a step that `stalled`."""
        if self.stalled(outputs):
            time.sleep(0.001)

    def _launch(self, plan, prev, results: list[RequestOutput]):
        """(handle, prev): launch `plan`. If it raises, collect `prev` first (into
        `results`), fail the requests whose own inputs raise (engine/isolation.py)
        and plan and launch the others again; prev is then None."""
        while not plan.is_empty:
            try:
                t0 = time.perf_counter()
                kind = step_kind(plan)
                if self.profiler is None:
                    handle = self.runner.launch(plan, prev)
                else:
                    with self.profiler.annotate(f"detent.step.{kind}"):
                        handle = self.runner.launch(plan, prev)
                t1 = time.perf_counter()
                self.step_stats.on_launch(kind, handle, t0, t1, self.scheduler.num_left_out(plan))
                return handle, prev
            except Exception as e:  # noqa: BLE001 - judged by _undo: one request's, or re-raised
                if prev is not None:
                    results += self._finish_step(prev)
                    prev = None
                results += self._undo(plan, e)
            plan = self.scheduler.schedule()
        return None, prev

    def _undo(self, plan, e: Exception) -> list[RequestOutput]:
        """A step launched for `plan` raised: its requests return to the queue, and
        those whose own inputs raise fail (engine/isolation.py); an error no request
        caused is raised again."""
        self.scheduler.retract(plan)
        culprits = find_culprits(plan, self.model_config.vocab_size, *self._probe_target())
        if not culprits and not isinstance(e, (ValueError, NotImplementedError)):
            raise e
        # no single culprit for a request-level error: the step's requests fail together
        return self._fail(culprits or {s.request_id: f"{type(e).__name__}: {e}" for s in plan.seqs})

    def _sample_deferred(self, handle) -> Exception | None:
        """Queue `handle`'s deferred sampling, if it has one; what it raised, for `_undo`."""
        if getattr(handle, "deferred", None) is None:
            return None
        t0 = time.perf_counter()
        try:
            self.runner.sample_deferred(handle, self.scheduler.requests.__contains__)
        except Exception as e:  # noqa: BLE001 - judged by _undo: one request's, or re-raised
            return e
        finally:  # part of the step's launch
            self.step_stats.add_launch_time(handle.plan, time.perf_counter() - t0)
        return None

    def _probe_target(self):
        """(dispatcher, device) to probe sampling rows with (engine/isolation.py)."""
        if self.dispatcher is not None:
            return self.dispatcher, self.state.device
        # tensor parallel: the ranks hold the dispatchers; a CPU one raises for the same rows
        from detent.selection import make_dispatcher
        cpu = {**self.facts, "device": "cpu", "arch": "cpu", "triton": False}
        return make_dispatcher(cpu, "stock"), torch.device("cpu")

    def _needs_tokens_first(self, handle) -> bool:
        """Must `handle`'s tokens reach the host before the next plan is made?"""
        reqs = self.scheduler.requests
        return any(s.sample is not None and s.request_id in reqs
                   and self.scheduler.waits_for_token(reqs[s.request_id]) for s in handle.plan.seqs)

    def _finish_step(self, handle) -> list[RequestOutput]:
        """Collect a launched step, advance the requests, emit their outputs."""
        return self._emit_all(self._advance(handle))

    def _advance(self, handle) -> dict[str, None]:
        """Collect a launched step and advance its requests; the groups that progressed."""
        t0 = time.perf_counter()
        out = self.runner.collect(handle)
        t1 = time.perf_counter()
        waited = t1 - t0
        progressed = self.scheduler.update(handle.plan, out)  # every stop decided here
        self._num_steps += 1
        self.step_stats.on_collect(handle, waited, busy=bool(self.scheduler.running or self.scheduler.waiting))
        groups = {self.outputs.parent_of[req.request_id]: None for req in progressed}
        self.host_seconds["update"] += time.perf_counter() - t1
        return groups

    def _emit_all(self, groups: dict[str, None]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outs = [self._emit(g) for g in groups]
        self.host_seconds["outputs"] += time.perf_counter() - t0
        return outs

    def _fail(self, errors: dict[str, str]) -> list[RequestOutput]:
        """Finish these requests (finish_reason "error", with the message); the engine goes on."""
        groups: dict[str, None] = {}
        for rid, message in errors.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:
                req.error = message
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                groups[self.outputs.parent_of[req.request_id]] = None
        return [self._emit(g) for g in groups]

    def stats(self) -> dict[str, Any]:
        bm, sch = self.block_manager, self.scheduler
        waiting = list(sch.waiting)  # one C-level copy: safe while the step thread edits the deque
        return {
            "num_running": len(sch.running),
            "num_waiting": len(waiting) + len(self._inbox),
            # waiting for their grammar to compile, not for room (vLLM's "deferred" waiting reason)
            "num_waiting_deferred": sum(1 for r in waiting if r.grammar is not None and r.grammar.pending),
            "kv_cache_usage": bm.usage,
            "num_kv_blocks": bm.num_usable_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_queries": bm.queries,
            "prefix_cache_hits": bm.hits,
            "num_preemptions": sch.num_preemptions,
            "num_steps": self._num_steps,
            "steps_by_kind": self.step_stats.as_dict(),
            "host_seconds": self.host_time(),
        }

    def host_time(self) -> dict[str, float]:
        """The step loop's host seconds by part (HOST_PARTS); launch and wait summed over the step kinds."""
        return self.step_stats.host_time(self.host_seconds)

    def update_weights(self, named_tensors) -> int:
        """Copy new weights (checkpoint names) into the model in place; see engine/weight_update.py."""
        from detent.engine.weight_update import update_engine
        return update_engine(self, named_tensors)

    def reset_prefix_cache(self) -> bool:
        with self._step_lock:
            return self.block_manager.reset_prefix_cache()

    def get_tokenizer(self):
        return self.tokenizer

    def fingerprint(self) -> Fingerprint:
        """The (tuple hash, deployment hash) pair responses carry: what a
        replay needs to match to reproduce a request's bits."""
        return fingerprint(self.facts, selection=self.config.selection, tuple_path=self.config.tuple,
                           active_tuple=getattr(self.dispatcher, "tuple", None), knobs=self.config.tuple_knobs())

    def limits(self) -> EngineLimits:
        c = self.config
        return EngineLimits(int(self.state.max_model_len), int(self.model_config.vocab_size), c.max_logprobs,
                            c.max_num_seqs, c.max_num_batched_tokens, int(self.state.block_size),
                            int(self.state.num_usable_blocks * self.state.block_size), self.eos_token_ids)

"""Grammar-constrained decoding with xgrammar: a compile cache and a per-request state.

GrammarCompilerCache (one per tokenizer + model vocabulary): one compiled
grammar per (tokenizer, grammar spec) in an LRU. A spec over the cache's
GrammarLimits is refused (grammar_limits.py). Compilation runs off the step
loop in the lanes of grammar_workers.py: first in a worker process that is
killed if it passes the timeout (so a timed-out compile stops), then in the
lane's thread (xgrammar releases the GIL); small specs and large ones have
separate lanes, so small grammars compile while large ones run. A lane holds
at most `limits.max_queued_compiles` waiting jobs: a new spec past it is
refused (grammar_workers.CompileQueueFull). Each state holds its job's
future (`fut.wanted` counts them, under the cache's lock); when the last
is released (`GrammarState.release`, at the request's finish: done, aborted
or failed) before a worker began the job, the job is dropped from its lane
and from the cache, never compiled.

GrammarState (one per request): pending until its compilation finishes,
then a matcher. The engine (docs/architecture.md, "Grammar in the
scheduler") skips a request while `not ready`, fails it with
finish_reason "error" when `error` is set (compile error or timeout), lets
the sampler read `bitmask()`, and calls `accept(token)` for each committed
token. EOS (the tokenizer info's stop tokens) is allowed only where the
grammar may end. A model vocabulary padded beyond the tokenizer's is handled
by building the tokenizer info with the model's vocab size: padded ids are
never allowed.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Sequence

import torch
import xgrammar as xgr

from detent.sampling import grammar_workers
from detent.sampling.grammar_limits import GrammarLimits, check_limits
from detent.sampling.params import StructuredOutputs, _short


def _as_hf_tokenizer(tokenizer):
    """xgrammar reads a transformers tokenizer; Detent's models.Tokenizer wraps a `tokenizers` one."""
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    import tokenizers
    inner = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tok", None)
    if isinstance(inner, tokenizers.Tokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=getattr(tokenizer, "eos_token", None))
    raise ValueError(f"structured outputs need a Hugging Face tokenizer (tokenizer.json); got {type(tokenizer).__name__}")


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, sized to the model's vocabulary (padded ids never allowed).

    A Hugging Face tokenizer (or Detent's models.Tokenizer), an xgrammar
    TokenizerInfo as is, or any tokenizer with `raw_vocab` (the literal text
    of each token id, for test tokenizers)."""
    if isinstance(tokenizer, xgr.TokenizerInfo):
        return tokenizer
    stops = list(stop_token_ids) if stop_token_ids else None
    raw = getattr(tokenizer, "raw_vocab", None)
    if raw is not None:
        return xgr.TokenizerInfo(list(raw), xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    return xgr.TokenizerInfo.from_huggingface(_as_hf_tokenizer(tokenizer), vocab_size=vocab_size,
                                              stop_token_ids=stops)


def _tokenizer_key(info: xgr.TokenizerInfo) -> str:
    h = hashlib.sha256()
    h.update(info.dump_metadata().encode())
    for tok in info.decoded_vocab:
        h.update(len(tok).to_bytes(4, "little"))
        h.update(tok)
    return h.hexdigest()[:16]


class GrammarCompilerCache:
    DEFAULT_TIMEOUT_S = 30.0  # a request whose grammar takes longer fails with finish_reason "error"

    def __init__(self, tokenizer=None, vocab_size: int | None = None, *,
                 stop_token_ids: Sequence[int] | None = None, info: xgr.TokenizerInfo | None = None,
                 max_entries: int = 256, timeout_s: float | None = None,
                 limits: GrammarLimits = GrammarLimits()) -> None:
        timeout_s = self.DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        if info is None:
            if tokenizer is None or vocab_size is None:
                raise ValueError("GrammarCompilerCache needs a tokenizer and the model's vocab_size (or an info)")
            info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        if max_entries < 1 or timeout_s <= 0:
            raise ValueError(f"GrammarCompilerCache: max_entries must be >= 1 and timeout_s > 0, "
                             f"got {max_entries}, {timeout_s}")
        self.info = info
        self.vocab_size = info.vocab_size
        self.tokenizer_key = _tokenizer_key(info)
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self.limits = limits
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._info_json: str | None = None
        grammar_workers.warm()
        self._lru: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def submit(self, spec: StructuredOutputs, want: bool = False, checked: bool = False,
               key: str | None = None) -> Future:
        """The compiled grammar for `spec`, as a future (shared by every request with this spec).
        ValueError (naming the limit) for a spec over `self.limits`; CompileQueueFull (a
        ValueError) for a new spec whose lane already holds `max_queued_compiles` waiting jobs.
        `want`: count one more holder of the future (new_state's), in the same locked step as
        the lookup, so a release in another thread cannot drop the job in between. `checked`: the
        caller has checked the spec against these limits (the engine's admission: a spec a
        server's worker checked, or a request's later samples), which are not walked again. `key`:
        `spec.key()`, made by the caller (a server's worker, once for a request's samples)."""
        if not checked:
            check_limits(spec, self.limits)
        key = (self.tokenizer_key, spec.key() if key is None else key)
        with self._lock:
            fut = self._lru.get(key)
            if fut is not None:
                self._lru.move_to_end(key)
                self.hits += 1
            else:
                fut = grammar_workers.submit(self._job(spec), self._compile_here, self.timeout_s,
                                             max_queued=self.limits.max_queued_compiles)
                self.misses += 1
                fut.cache_key, fut.wanted = key, 0
                self._lru[key] = fut
                while len(self._lru) > self.max_entries:
                    self._lru.popitem(last=False)
            if want:
                fut.wanted += 1
            return fut

    def release(self, fut: Future) -> None:
        """One holder of `fut` (a request's state) is gone. When it was the last and no worker
        has begun the job, the job is dropped (never compiled) and leaves the cache, so the
        next request with its spec submits it again. A begun job runs on and stays cached:
        a client retrying the same spec finds it (grammar_workers.py says why)."""
        with self._lock:
            fut.wanted -= 1
            if fut.wanted > 0 or fut.done():
                return
            if grammar_workers.drop(fut) and self._lru.get(fut.cache_key) is fut:
                del self._lru[fut.cache_key]

    def _job(self, spec: StructuredOutputs) -> grammar_workers.CompileJob:
        if self._info_json is None:
            self._info_json = self.info.serialize_json()
        kind, ws = spec.kind, spec.any_whitespace
        if kind in ("json", "json_object"):
            text = json.dumps(spec.json) if kind == "json" else '{"type": "object"}'
            return grammar_workers.CompileJob(self.tokenizer_key, self._info_json, "json", text, ws, kind == "json")
        if kind == "regex":
            return grammar_workers.CompileJob(self.tokenizer_key, self._info_json, "regex", spec.regex, ws, True)
        text = spec.grammar if kind == "grammar" else "root ::= " + " | ".join(
            json.dumps(s, ensure_ascii=False) for s in spec.choice)
        return grammar_workers.CompileJob(self.tokenizer_key, self._info_json, "grammar", text, ws, True)

    def _compile_here(self, job: grammar_workers.CompileJob) -> xgr.CompiledGrammar:
        return grammar_workers.compile_job(self._compiler, job)

    def new_state(self, spec: StructuredOutputs, checked: bool = False,
                  key: str | None = None) -> "GrammarState | DeferredGrammar":
        """A request's grammar (its compile submitted, or shared); `release()` it when the
        request is gone. Raises as `submit` does (`checked`, `key`: as its)."""
        state = GrammarState(self.submit(spec, want=True, checked=checked, key=key), self.vocab_size,
                             self.timeout_s, release=self.release)
        if spec.start_after_token_ids:
            return DeferredGrammar(state, spec.start_after_token_ids, self.vocab_size)
        return state

    def __len__(self) -> int:
        return len(self._lru)

    def shutdown(self) -> None:
        """Nothing to stop: the compile lanes are shared by the process (grammar_workers.py)."""


class GrammarState:
    """One request's grammar: pending -> ready (a matcher) or error (message)."""

    def __init__(self, future: Future, vocab_size: int, timeout_s: float, release=None) -> None:
        self._future = future
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._release = release  # the cache's release(future), called once
        self._matcher: xgr.GrammarMatcher | None = None
        self._error: str | None = None
        self.num_accepted = 0

    def release(self) -> None:
        """The request is finished (done, aborted or failed): it no longer wants the compile,
        which is dropped if no other request does and no worker has begun it. Idempotent;
        a matcher already built stays usable."""
        release, self._release = self._release, None
        if release is not None:
            release(self._future)

    def _poll(self) -> None:
        if self._matcher is not None or self._error is not None:
            return
        if self._future.cancelled():  # dropped, which happens only once no request wants it
            self._error = "grammar compilation was dropped: no request waited for it any more"
            return
        if self._future.done():
            exc = self._future.exception()
            if exc is not None:
                self._error = f"grammar compilation failed: {_short(exc)}"
            else:
                self._matcher = xgr.GrammarMatcher(self._future.result())
            return
        # the compile in the worker is killed at the timeout; this also bounds the compile for the
        # engine after it: twice the timeout from when a worker began it (CompileFuture.started),
        # never from the request's arrival, which would charge it a hostile compile ahead of it in
        # the lane and that worker's restart
        started = getattr(self._future, "started", None)
        if started is not None and time.monotonic() > started + 2 * self._timeout_s:
            self._error = (f"grammar compilation timed out: not compiled {2 * self._timeout_s:g} s after its "
                           f"compile began (compile timeout {self._timeout_s:g} s)")

    @property
    def ready(self) -> bool:
        self._poll()
        return self._matcher is not None

    @property
    def pending(self) -> bool:
        """Still compiling as of the last poll (reads only: safe from a thread that is not the step's)."""
        return self._matcher is None and self._error is None

    @property
    def error(self) -> str | None:
        self._poll()
        return self._error

    def _m(self) -> xgr.GrammarMatcher:
        if not self.ready:
            raise RuntimeError(f"grammar state used before it is ready (error: {self.error})")
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Write the allowed-token bitmask into row `index` of an int32 [N, ceil(V/32)] CPU tensor."""
        self._m().fill_next_token_bitmask(bitmask, index)

    def bitmask(self) -> torch.Tensor:
        """The allowed-token bitmask, int32 [ceil(V/32)] (bit t of word t // 32 set: token t allowed)."""
        bm = xgr.allocate_token_bitmask(1, self._vocab_size)
        self.fill_bitmask(bm, 0)
        return bm[0]

    def accept(self, token_id: int) -> bool:
        ok = self._m().accept_token(int(token_id))
        self.num_accepted += int(ok)
        return ok

    def rollback(self, n: int) -> None:
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"rollback({n}): only {self.num_accepted} tokens accepted")
        if n:
            self._m().rollback(n)
            self.num_accepted -= n

    def is_terminated(self) -> bool:
        return self._m().is_terminated()


class DeferredGrammar:
    """A grammar that binds once the output ends with `trigger` (StructuredOutputs.start_after_token_ids):
    until then every token is allowed and none reaches the matcher; the trigger's own
    tokens are free too. The engine sees GrammarState's interface. A request's
    tokens alone decide when it binds, so its bits cannot depend on its batch."""

    def __init__(self, inner: GrammarState, trigger: Sequence[int], vocab_size: int) -> None:
        self.inner, self.trigger, self.vocab_size = inner, tuple(trigger), vocab_size
        self._tail: list[int] = []  # the last len(trigger) free tokens
        self.bound = False

    def release(self) -> None:
        self.inner.release()

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def pending(self) -> bool:
        return self.inner.pending

    @property
    def error(self) -> str | None:
        return self.inner.error

    def fill_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        if self.bound:
            self.inner.fill_bitmask(bitmask, index)
        else:
            bitmask[index].fill_(-1)  # every bit set: every token allowed

    def bitmask(self) -> torch.Tensor:
        if self.bound:
            return self.inner.bitmask()
        return torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)

    def accept(self, token_id: int) -> bool:
        if self.bound:
            return self.inner.accept(token_id)
        self._tail = (self._tail + [int(token_id)])[-len(self.trigger):]
        self.bound = tuple(self._tail) == self.trigger
        return True

    def rollback(self, n: int) -> None:
        """Only tokens the grammar bound (a rollback into the free prefix would have to unbind it)."""
        if n and not self.bound:
            raise ValueError(f"rollback({n}): the grammar has not bound yet, no token was accepted by it")
        self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return self.bound and self.inner.is_terminated()

"""What the tensor-parallel ranks are sent for a step: its plan, made portable.

Every step's plan (a `SchedulerOutput`) is pickled and sent to every rank.
Two things in it do not travel as they are:
- a grammar state, whose matcher lives with the scheduler in the driver: the
  ranks get this step's bitmask (`FrozenGrammar`);
- a row's sampling parameters and token ids. A request may carry 100k bad
  words, a 40k-entry logit_bias or a vocabulary of allowed ids; pickled into
  every step's plan, they made each step's message as large (400 KB a step
  for 50k two-token bad words; now 1.1 KB after the first, as a plain
  request's). Its prompt (for the penalties) is as constant, and was 8 bytes a
  token a row a step (64 rows of 8k-token prompts: 4 MB a step), and its
  output only grows. The driver (`PlanSender`) sends a request's parameters
  (its `RequestMaskIds`, which holds them) and prompt with the first plan
  that samples it, then a `ParamsRef`, and of the output only the tokens the
  ranks have not had; each rank (`KeptParams`) keeps them, with the mask
  tables it builds from them, until the driver drops them: when the request
  finishes (`SchedulerOutput.finished_ids`), or when more than `KEPT_PARAMS`
  requests are kept (the least recently planned, sent again if planned
  again). A rank asked for parameters or outputs it does not hold raises, so
  the step fails instead of sampling under others.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

# requests whose parameters the ranks keep at most: a batch's (max_num_seqs, 256 by default)
# and some planned before (preempted, or finished and not yet dropped)
KEPT_PARAMS = 512


class FrozenGrammar:
    """A grammar state's bitmask for this step, picklable: the matcher lives
    with the scheduler in the driver; the ranks' sampler only reads the mask."""

    def __init__(self, bitmask):
        self._bitmask = bitmask.cpu()

    def bitmask(self):
        return self._bitmask


@dataclass(frozen=True)
class ParamsRef:
    """A row's `mask_ids` in a plan sent to the ranks, whose `params` is None and whose
    `prompt_token_ids` are empty: the request's RequestMaskIds (its SamplingParams with
    it) and prompt, which every rank keeps under the request's id, are the ones of this
    key. The row's `output_token_ids` are the output's tokens from `start` on, `total`
    in all: the rank holds those before `start`."""
    key: str
    start: int = 0
    total: int = 0


class PlanSender:
    """The driver's side: each step's message, and which requests' parameters every
    rank keeps (each rank's `KeptParams` follows the messages' `params` and `drop`)."""

    def __init__(self, capacity: int = KEPT_PARAMS):
        self.capacity = capacity
        # request id -> (the key of the RequestMaskIds the ranks keep for it, how many of its
        # output tokens they hold), least recently planned first
        self.kept: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def message(self, kind: str, plan) -> tuple[str, Any, dict[str, Any], tuple[str, ...]]:
        """(kind, plan, params, drop): the plan with its grammar states frozen and its rows'
        parameters referenced; the RequestMaskIds and prompts the ranks lack, by request id;
        the request ids whose parameters the ranks drop before they take `params`."""
        drop = [rid for rid in plan.finished_ids if self.kept.pop(rid, None) is not None]
        params, seqs, referenced = {}, [], set()
        for s in plan.seqs:
            row, rid = s.sample, s.request_id
            if row is not None and row.grammar is not None:
                row = replace(row, grammar=FrozenGrammar(row.grammar.bitmask()))
            if row is not None and row.mask_ids is not None:
                key, outs = row.mask_ids.key, row.output_token_ids
                held_key, held = self.kept.get(rid, (None, 0))
                if held_key != key:
                    params[rid] = (row.mask_ids, np.asarray(row.prompt_token_ids, dtype=np.int64))
                    held = 0
                start = held if held <= len(outs) else 0  # outputs only grow
                self.kept[rid] = (key, len(outs))
                self.kept.move_to_end(rid)
                referenced.add(rid)
                row = replace(row, params=None, mask_ids=ParamsRef(key, start, len(outs)), prompt_token_ids=(),
                              output_token_ids=np.asarray(outs[start:], dtype=np.int64))
            seqs.append(s if row is s.sample else replace(s, sample=row))
        # this plan's, the most recently planned, are never dropped for room
        while len(self.kept) > self.capacity and next(iter(self.kept)) not in referenced:
            drop.append(self.kept.popitem(last=False)[0])
        return kind, replace(plan, seqs=tuple(seqs)), params, tuple(drop)


@dataclass
class Held:
    """What a rank keeps of one request: its RequestMaskIds (parameters, and the mask tables
    built from them), its prompt, and the output tokens sent so far."""
    masks: Any
    prompt: np.ndarray
    outputs: np.ndarray


class KeptParams:
    """A rank's side: what it holds of the requests the driver sent, by request id."""

    def __init__(self):
        self.kept: dict[str, Held] = {}

    def plan(self, plan, params: dict[str, Any], drop: tuple[str, ...]):
        """The sent plan with its rows' parameters and token ids back."""
        for rid in drop:
            self.kept.pop(rid, None)
        for rid, (masks, prompt) in params.items():
            prompt.flags.writeable = False  # shared by every step's row, as the driver's Request.prompt_array
            self.kept[rid] = Held(masks, prompt, np.empty(0, dtype=np.int64))
        seqs = []
        for s in plan.seqs:
            ref = None if s.sample is None else s.sample.mask_ids
            if isinstance(ref, ParamsRef):
                rid = s.request_id
                h = self.kept.get(rid)
                if h is None or h.masks.key != ref.key:
                    raise LookupError(f"this rank holds no sampling parameters for request {rid!r} "
                                      f"(key {ref.key}; it holds {'none' if h is None else h.masks.key}): "
                                      "the driver sends them once, with a request's first plan")
                tail = s.sample.output_token_ids
                if len(h.outputs) < ref.start or ref.start + len(tail) != ref.total:
                    raise LookupError(f"request {rid!r}: this rank holds {len(h.outputs)} output tokens, the plan "
                                      f"sends {len(tail)} from {ref.start} of {ref.total}")
                h.outputs = np.concatenate([h.outputs[:ref.start], tail])
                h.outputs.flags.writeable = False
                s = replace(s, sample=replace(s.sample, params=h.masks.params, mask_ids=h.masks,
                                              prompt_token_ids=h.prompt, output_token_ids=h.outputs))
            seqs.append(s)
        return replace(plan, seqs=tuple(seqs))

"""What the tensor-parallel ranks are sent for a step: its plan, made portable.

Every step's plan (a `SchedulerOutput`) is pickled and sent to every rank.
Two things in it do not travel as they are:
- a grammar state, whose matcher lives with the scheduler in the driver: the
  ranks get this step's bitmask (`FrozenGrammar`);
- a row's sampling parameters. A request may carry 100k bad words, a
  40k-entry logit_bias or a vocabulary of allowed ids; pickled into every
  step's plan, they made each step's message as large (400 KB a step for 50k
  two-token bad words; now 1.1 KB after the first, as a plain request's).
  The driver (`PlanSender`) sends a request's parameters (its
  `RequestMaskIds`, which holds them) with the first plan that samples it,
  and a `ParamsRef` after; each rank (`KeptParams`) keeps them, with the mask
  tables it builds from them, until the driver drops them: when the request
  finishes (`SchedulerOutput.finished_ids`), or when more than `KEPT_PARAMS`
  requests are kept (the least recently planned, sent again if planned
  again). A rank asked for parameters it does not hold raises, so the step
  fails instead of sampling under other parameters.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

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
    """A row's `mask_ids` in a plan sent to the ranks, whose `params` is None: the
    request's RequestMaskIds (its SamplingParams with it), which every rank keeps
    under the request's id, is the one of this key."""
    key: str


class PlanSender:
    """The driver's side: each step's message, and which requests' parameters every
    rank keeps (each rank's `KeptParams` follows the messages' `params` and `drop`)."""

    def __init__(self, capacity: int = KEPT_PARAMS):
        self.capacity = capacity
        # request id -> the key of the RequestMaskIds the ranks keep for it, least recently planned first
        self.kept: OrderedDict[str, str] = OrderedDict()

    def message(self, kind: str, plan) -> tuple[str, Any, dict[str, Any], tuple[str, ...]]:
        """(kind, plan, params, drop): the plan with its grammar states frozen and its rows'
        parameters referenced; the RequestMaskIds the ranks lack, by request id; the request
        ids whose parameters the ranks drop before they take `params`."""
        drop = [rid for rid in plan.finished_ids if self.kept.pop(rid, None) is not None]
        params, seqs, referenced = {}, [], set()
        for s in plan.seqs:
            row = s.sample
            if row is not None and row.grammar is not None:
                row = replace(row, grammar=FrozenGrammar(row.grammar.bitmask()))
            if row is not None and row.mask_ids is not None:
                key = row.mask_ids.key
                if self.kept.get(s.request_id) != key:
                    params[s.request_id] = row.mask_ids
                self.kept[s.request_id] = key
                self.kept.move_to_end(s.request_id)
                referenced.add(s.request_id)
                row = replace(row, params=None, mask_ids=ParamsRef(key))
            seqs.append(s if row is s.sample else replace(s, sample=row))
        # this plan's, the most recently planned, are never dropped for room
        while len(self.kept) > self.capacity and next(iter(self.kept)) not in referenced:
            drop.append(self.kept.popitem(last=False)[0])
        return kind, replace(plan, seqs=tuple(seqs)), params, tuple(drop)


class KeptParams:
    """A rank's side: the RequestMaskIds (parameters, and the mask tables built from
    them) of the requests the driver sent, by request id."""

    def __init__(self):
        self.kept: dict[str, Any] = {}

    def plan(self, plan, params: dict[str, Any], drop: tuple[str, ...]):
        """The sent plan with its rows' parameters back."""
        for rid in drop:
            self.kept.pop(rid, None)
        self.kept.update(params)
        seqs = []
        for s in plan.seqs:
            ref = None if s.sample is None else s.sample.mask_ids
            if isinstance(ref, ParamsRef):
                masks = self.kept.get(s.request_id)
                if masks is None or masks.key != ref.key:
                    raise LookupError(f"this rank holds no sampling parameters for request {s.request_id!r} "
                                      f"(key {ref.key}; it holds {'none' if masks is None else masks.key}): "
                                      "the driver sends them once, with a request's first plan")
                s = replace(s, sample=replace(s.sample, params=masks.params, mask_ids=masks))
            seqs.append(s)
        return replace(plan, seqs=tuple(seqs))

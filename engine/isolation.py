"""Which requests made a step raise.

A step's forward reads only token ids, positions and blocks, all validated
when a request is added; what a request brings on top (sampling parameters,
logits processors, penalties, logit_bias, a grammar, a golden token) runs in
the sampler. When a step raises, each of its sampling rows is run through
the sampler again, alone, on zero logits: a row that raises there is the
culprit, whatever its neighbours. The engine fails those requests (finish
reason "error", with the message) and runs the others again
(`LLMEngine._launch`); they recompute as after a preemption, so their bits
are those they would have had if the culprit had never come.
"""
from __future__ import annotations

import torch

from detent.sampling import sampler as sampling
from detent.scheduler.outputs import SchedulerOutput
from detent.selection.dispatch import Dispatcher, use_dispatcher


def find_culprits(plan: SchedulerOutput, vocab_size: int, dispatcher: Dispatcher,
                  device: torch.device) -> dict[str, str]:
    """request id -> the error its sampling row raises alone (requests whose row does not raise are left out)."""
    out: dict[str, str] = {}
    zeros = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    # a row whose last token was still on the device (async scheduling) reads one: any will do
    last = torch.zeros(1, dtype=torch.long, device=device)
    with use_dispatcher(dispatcher):
        for seq in plan.seqs:
            if seq.sample is None:
                continue
            try:
                sampling.sample_async(zeros, [seq.sample], last if seq.sample.pending else None).resolve()
            except Exception as e:  # noqa: BLE001 - any error of one row is that request's
                out[seq.request_id] = f"{type(e).__name__}: {e}"
    return out

"""An independent float64 reference of the sampling transformation (numpy only).

Written from the documented contract (sampling/processors.py docstring and
vLLM's semantics), not by calling Detent's processors:
  allowed/logit_bias/min_tokens -> repetition, frequency, presence penalties ->
  temperature -> top-k (keep >= k-th largest) -> top-p (smallest prefix in
  descending order, ties to the lower id, whose mass reaches top_p) ->
  min-p (p_i >= min_p * p_max) -> grammar mask -> renormalize.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np


def reference_probs(logits, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
                    repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                    prompt_ids=(), output_ids=(), allowed=None) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).copy()
    V = x.shape[0]
    seen = set(prompt_ids) | set(output_ids)
    for t in seen:
        if repetition_penalty != 1.0:
            x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
    for t in set(output_ids):
        c = list(output_ids).count(t)
        x[t] -= frequency_penalty * c + presence_penalty
    x = x / temperature
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    p = np.exp(x - x[keep].max()) * keep
    p /= p.sum()
    if top_p < 1.0:
        order = sorted(range(V), key=lambda t: (-x[t], t))
        mass = 0.0
        nucleus = np.zeros(V, dtype=bool)
        for t in order:
            if mass >= top_p:
                break
            nucleus[t] = True
            mass += p[t]
        keep &= nucleus
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if allowed is not None:
        keep &= np.asarray(allowed, dtype=bool)
    q = np.exp(x - x[keep].max()) * keep
    return q / q.sum()


def exact_nucleus(probs: list[float], top_p: float) -> list[int]:
    """The ids top-p keeps from one row's probabilities (as the sampler computed them, float32),
    ascending: a token is kept when the mass strictly before it, in the order probability
    descending / ties to the lower id, is < top_p, summed exactly (fractions); top_p 1 keeps all."""
    if top_p >= 1.0:
        return list(range(len(probs)))
    kept, before, limit = [], Fraction(0), Fraction(top_p)
    for t in sorted(range(len(probs)), key=lambda t: (-probs[t], t)):
        if before >= limit:
            break
        kept.append(t)
        before += Fraction(probs[t])
    return sorted(kept)

"""Sampling: SamplingParams (params.py), the keyed Philox RNG (rng.py), row-wise
logits processors (processors.py), the sampler with logprobs and golden tokens
(sampler.py) and xgrammar structured outputs (grammar.py). The contract and the
order of transformations are in docs/architecture.md ("Sampling", "Grammar in
the scheduler")."""

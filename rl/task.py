"""Verifiable tasks for GRPO: a problem is prompt token ids plus whatever its
reward needs; the reward is a program, never a model.

`ArithmeticTask`: "What is 23 + 48?" through the model's chat template,
reward 1.0 when the first integer in the completion is the answer, 0.5 when
the answer is some later integer ("1 + 8 equals 9."), 0.0 otherwise.
SmolLM2-135M-Instruct at temperature 1 writes the answer somewhere in a few
of its samples from the start, so the group advantage has signal from step
one, and the full reward asks for the answer first.

`TargetTokenTask`: token-level, no tokenizer: reward is the fraction of
completion tokens equal to a target id (for tiny random test models).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Protocol, Sequence


@dataclass(frozen=True)
class Problem:
    prompt_ids: tuple[int, ...]
    answer: Any


class Task(Protocol):
    def sample(self, rng: random.Random) -> Problem: ...

    def reward(self, problem: Problem, completion_ids: Sequence[int]) -> float: ...


_INT = re.compile(r"-?\d+")


class ArithmeticTask:
    def __init__(self, tokenizer, max_operand: int = 50, op: str = "+"):
        if op not in ("+", "-", "*"):
            raise ValueError(f"op must be '+', '-' or '*', got {op!r}")
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("ArithmeticTask needs a tokenizer with a chat template")
        self.tok, self.max_operand, self.op = tokenizer, max_operand, op

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        answer = {"+": a + b, "-": a - b, "*": a * b}[self.op]
        msg = [{"role": "user", "content": f"What is {a} {self.op} {b}? Reply with the number only."}]
        text = self.tok.apply_chat_template(msg, add_generation_prompt=True)
        return Problem(tuple(self.tok.encode(text, add_special_tokens=False)), answer)

    def reward(self, problem: Problem, completion_ids: Sequence[int]) -> float:
        nums = [int(m) for m in _INT.findall(self.tok.decode(list(completion_ids), skip_special_tokens=True))]
        if nums and nums[0] == problem.answer:
            return 1.0
        return 0.5 if problem.answer in nums else 0.0


class TargetTokenTask:
    def __init__(self, vocab_size: int, target: int = 7, prompt_len: int = 6):
        self.vocab, self.target, self.prompt_len = vocab_size, target, prompt_len

    def sample(self, rng: random.Random) -> Problem:
        return Problem(tuple(rng.randrange(2, self.vocab) for _ in range(self.prompt_len)), self.target)

    def reward(self, problem: Problem, completion_ids: Sequence[int]) -> float:
        ids = list(completion_ids)
        return sum(t == problem.answer for t in ids) / max(1, len(ids))

"""What a request must satisfy to be admitted (`LLMEngine.add_request`): its id, its prompt's
token ids against the vocabulary and the context, and its sampling parameters against the
engine's vocabulary, logprob limit, RL contract and grammar limits. Each failure is a
ValueError naming the field. Parameters a server's worker checked for this vocabulary
(`checked_params`) are not walked again: the engine admits on its step thread."""
from __future__ import annotations

from typing import Any, Sequence

from detent.engine.inputs import token_id_list
from detent.sampling.grammar_limits import check_limits
from detent.sampling.params import SamplingParams, tokenize_bad_words
from detent.sampling.processors import checked_for


def admitted_prompt(request_id: str, prompt_token_ids: Sequence[int], p: SamplingParams, *, vocab: int,
                    max_model_len: int, max_logprobs: int, rl: bool, tokenizer: Any) -> list[int]:
    """The prompt's token ids as a list, once the request is checked (`p`'s bad words are
    tokenized on it here, once, as vLLM does at admission)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    ids = token_id_list("prompt_token_ids", prompt_token_ids)
    if not ids:
        raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if len(ids) > max_model_len:
        raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len={max_model_len}")
    if getattr(p, "bad_words", None) and p.bad_words_token_ids is None:
        if tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer (the engine has none); "
                             "pass bad_words_token_ids")
        p.bad_words_token_ids = tokenize_bad_words(p.bad_words, lambda t: tokenizer.encode(t, add_special_tokens=False))
    checked = checked_for(p, vocab)
    if checked is None and hasattr(p, "verify_vocab"):
        p.verify_vocab(vocab)
    if rl:
        from detent.engine.rl_contract import check_rl_params
        check_rl_params(p)
    if p.structured_outputs is not None:
        if tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer (the engine has none)")
        if checked is None:  # a ValueError naming the limit, before anything compiles
            check_limits(p.structured_outputs)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and k > max_logprobs:
            raise ValueError(f"{name}={k} exceeds max_logprobs={max_logprobs}")
    return ids

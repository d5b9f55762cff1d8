"""From an HTTP request body to engine inputs: prompt token ids and SamplingParams.

Every check here raises a 400 `APIError` naming the field or the limit. The
sampling values themselves are validated once, by `SamplingParams`, whose
`ValueError` becomes the 400's message.
"""
from __future__ import annotations

import re
from typing import Any

from detent.sampling.params import SamplingParams, StructuredOutputs
from detent.server.errors import APIError, bad_request
from detent.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling

MAX_LOGPROBS = 20
MAX_N = 128


def structured_outputs(req: _Sampling) -> StructuredOutputs | None:
    """The one structured-output constraint a request asks for (validated: a bad one is a 400)."""
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request("response_format.json_schema.schema is required for type json_schema",
                              "response_format.json_schema")
        found.append(("response_format.json_schema.schema", "json", rf.json_schema.json_schema))
    so = req.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None)):
            if value is not None:
                found.append((f"structured_outputs.{kind}", kind, value))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", kind, value))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("only one structured-output constraint per request, got "
                          + ", ".join(p for p, _, _ in found), found[1][0])
    param, kind, value = found[0]
    try:
        return StructuredOutputs(**{kind: value})
    except (ValueError, TypeError) as e:
        raise bad_request(f"invalid {param}: {e}", param) from None


def check_prompt_ids(ids: list[int], vocab_size: int | None, param: str = "prompt") -> None:
    if not ids:
        raise bad_request(f"{param} is empty: at least one prompt token is needed", param)
    if vocab_size is not None:
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise bad_request(f"{param} token id {t} at index {i} is outside the vocabulary "
                                  f"[0, {vocab_size})", param)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str) -> int:
    """max_tokens against the context: a prompt or a request over it is a 400 naming the limit."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens "
                            f"(--max-model-len); the prompt has {prompt_len} tokens, which leaves "
                            f"no room to generate.", param="prompt", code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise bad_request(f"{param} must be >= 1, got {requested}", param)
    if prompt_len + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens "
                            f"(--max-model-len); you requested {prompt_len + requested} tokens "
                            f"({prompt_len} in the prompt, {requested} for the completion). "
                            f"Reduce the prompt or {param}.", param=param, code="context_length_exceeded")
    return requested


def _range(value: int | None, lo: int, hi: int, param: str) -> None:
    if value is not None and not lo <= value <= hi:
        raise bad_request(f"{param} must be between {lo} and {hi}, got {value}", param)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None,
                    structured: StructuredOutputs | None) -> SamplingParams:
    _range(req.n, 1, MAX_N, "n")
    _range(logprobs, 0, MAX_LOGPROBS, "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
    _range(prompt_logprobs, 0, MAX_LOGPROBS, "prompt_logprobs")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    kw: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        golden_token_ids=req.golden_token_ids, structured_outputs=structured)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logprobs_mode"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise bad_request(f"invalid sampling parameters: {e}", _field_named(str(e))) from None


def _field_named(message: str) -> str | None:
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                 "seed", "stop", "golden_token_ids", "structured_outputs", "n"):
        if re.search(rf"\b{name}\b", message):
            return name
    return None

"""From an HTTP request body to engine inputs: prompt token ids and SamplingParams.

Every check here raises a 400 `APIError` naming the field or the limit. The
sampling values themselves are validated once, by `SamplingParams`, whose
`ValueError` becomes the 400's message.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from detent.engine import check_limits, check_spec_size, checked_params
from detent.sampling.params import MAX_INT32, SamplingParams, StructuredOutputs, tokenize_bad_words
from detent.server.errors import APIError, bad_request
from detent.server.limits import ServerLimits
from detent.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from detent.server.vllm_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_vllm_fields

MAX_LOGPROBS = 20
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,19}")  # a logit_bias key: one spelling per id


@dataclass(frozen=True)
class FieldNames:
    """The names a request's errors give its fields. A Responses request becomes a chat
    request (server/responses_input.py) whose errors still name the Responses fields."""
    messages: str = "messages"
    max_tokens: str | None = None  # None: max_tokens or max_completion_tokens, whichever was sent
    response_format: str = "response_format"
    json_schema: str = "response_format.json_schema"  # the object holding `schema`
    reasoning_effort: str = "reasoning_effort"


async def structured_outputs(req: _Sampling, preprocess,
                             names: FieldNames = FieldNames()) -> StructuredOutputs | None:
    """The one structured-output constraint a request asks for, validated on the
    preprocessing pool (a bad one is a 400): checking a spec (jsonschema's
    meta-schema, re.compile, xgrammar's grammar parser) costs time in its size."""
    found = _spec(req, names)
    return None if found is None else await preprocess.run(checked_spec, *found)


def _spec(req: _Sampling, names: FieldNames) -> tuple[str, str, Any] | None:
    """(param, kind, value) of the request's one structured-output constraint, or None."""
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((names.response_format, "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise bad_request(f"{names.json_schema}.schema is required for type json_schema", names.json_schema)
        found.append((f"{names.json_schema}.schema", "json", rf.json_schema.json_schema))
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
    return found[0]


def checked_spec(field: str, kind: str, value: Any, param: str | None = None) -> StructuredOutputs:
    """A request's structured-output spec, validated and within the engine's grammar limits, or a
    400 whose message opens with `field` (the name the client sent it under) and whose param is
    `param` (default `field`). The size bound comes first: validating costs time in the size.
    The other limits (nesting, properties, enum values, remote $ref) are the engine's own check
    at admission, made here so that the 400 names the client's field, not structured_outputs."""
    param = field if param is None else param
    try:
        check_spec_size(kind, value, field=field)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    try:
        spec = StructuredOutputs(**{kind: value})
    except (ValueError, TypeError) as e:  # "structured_outputs.regex does not compile: ...", said of `field`
        why, own = str(e), f"structured_outputs.{kind}"
        raise bad_request(field + why[len(own):] if why.startswith(own) else f"invalid {field}: {why}",
                          param) from None
    try:
        check_limits(spec, field=field)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return spec


def check_prompt_ids(ids: list[int], vocab_size: int | None, param: str = "prompt") -> None:
    if not ids:
        raise bad_request(f"{param} is empty: at least one prompt token is needed", param)
    if vocab_size is not None and not 0 <= min(ids) <= max(ids) < vocab_size:  # in C; the loop finds which
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise bad_request(f"{param} contains token id {t} (at index {i}), outside the vocabulary "
                                  f"[0, {vocab_size})", param)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, param: str,
                       default: int | None = None) -> int:
    """max_tokens against the context: a prompt or a request over it is a 400 naming the limit.
    Not requested: `default` (--generation-config's max_new_tokens), capped by the context."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens "
                            f"(--max-model-len); the prompt has {prompt_len} tokens, which leaves "
                            f"no room to generate.", param="prompt", code="context_length_exceeded")
    if requested is None:
        return min(default or max_model_len, max_model_len - prompt_len)
    if requested < 1:
        raise bad_request(f"{param} must be >= 1, got {requested}", param)
    if prompt_len + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens "
                            f"(--max-model-len); you requested {prompt_len + requested} tokens "
                            f"({prompt_len} in the prompt, {requested} for the completion). "
                            f"Reduce the prompt or {param}.", param=param, code="context_length_exceeded")
    return requested


def check_range(value: int | None, lo: int, hi: int, param: str, flag: str = "") -> None:
    if value is not None and not lo <= value <= hi:
        raise bad_request(f"{param} must be between {lo} and {hi}{f' ({flag})' if flag else ''}, got {value}", param)


def check_counts(req: CompletionRequest | ChatCompletionRequest, limits: ServerLimits, num_prompts: int) -> None:
    """The bounds that need no tokens, checked before any tokenizing: n, logprob
    counts, max_tokens, and how many sequences the request asks for."""
    check_vllm_fields(req.model_extra, CHAT_FIELDS if isinstance(req, ChatCompletionRequest) else COMPLETION_FIELDS)
    check_range(req.n, 1, limits.max_n, "n", "--max-n")
    if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
        # as vLLM: options for a stream on a request that does not stream are a client's mistake,
        # not silently dropped (an empty object asks for nothing and passes)
        raise bad_request("stream_options can only be given when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        check_range(req.best_of, 1, limits.max_n, "best_of", "--max-n")
        check_range(req.logprobs, 0, MAX_LOGPROBS, "logprobs")
    else:
        check_range(req.top_logprobs, 0, MAX_LOGPROBS, "top_logprobs")
        check_range(req.max_completion_tokens, 1, MAX_INT32, "max_completion_tokens")
    check_range(req.prompt_logprobs, 0, MAX_LOGPROBS, "prompt_logprobs")
    if isinstance(req, CompletionRequest) and req.echo:
        check_range(req.max_tokens, 0, MAX_INT32, "max_tokens")  # 0 with echo: score the prompt, generate nothing
    else:
        check_range(req.max_tokens, 1, MAX_INT32, "max_tokens")
    if num_prompts > limits.max_prompts:
        raise bad_request(f"prompt: {num_prompts} prompts in one request, over the limit of {limits.max_prompts} "
                          f"(--max-prompts-per-request)", "prompt")
    if num_prompts * req.n > limits.max_sequences:
        raise bad_request(f"n: {num_prompts} prompt(s) x n={req.n} is {num_prompts * req.n} sequences, over the "
                          f"limit of {limits.max_sequences} per request (--max-sequences-per-request)", "n")


def check_logprob_entries(limits: ServerLimits, prompt_lens: list[int], max_tokens: list[int], n: int,
                          logprobs: int | None, prompt_logprobs: int | None, prompt_copies: int) -> None:
    """The logprob values the response would hold (each token's top-k plus its own),
    over --max-logprob-entries: n x echo x prompt_logprobs built ~140 MB bodies."""
    total = 0
    if prompt_logprobs is not None:
        total += prompt_copies * sum(prompt_lens) * (prompt_logprobs + 1)
    if logprobs is not None:
        total += n * sum(max_tokens) * (logprobs + 1)
    if total > limits.max_logprob_entries:
        param = "prompt_logprobs" if prompt_logprobs is not None else "logprobs"
        raise bad_request(f"{param}: this request could return {total} logprob values (prompt tokens x "
                          f"(prompt_logprobs + 1) x copies + n x max_tokens x (logprobs + 1)), over the limit "
                          f"of {limits.max_logprob_entries} (--max-logprob-entries); ask for fewer", param)


def check_stop_chars(stop: str | list[str] | None, preprocess, param: str = "stop") -> None:
    """The stop strings (one, or a list), bounded as a prompt is (as bad_words are): the engine
    looks for each one in the output's text at every step of the request, so a million of them
    made every step of the whole batch several times slower."""
    if stop:
        preprocess.check_chars(len(stop) if isinstance(stop, str) else sum(len(s) for s in stop), param)


async def bad_words_ids(req: CompletionRequest | ChatCompletionRequest, preprocess) -> list[list[int]] | None:
    """The request's bad_words, tokenized on the preprocessing pool as vLLM does (sampling/params.py)."""
    if not req.bad_words:
        return None
    preprocess.check_chars(sum(len(w) for w in req.bad_words), "bad_words")
    encode = functools.partial(_encode_plain, preprocess.tokenizer)
    try:
        return await preprocess.run(tokenize_bad_words, req.bad_words, encode)
    except ValueError as e:
        raise bad_request(str(e), "bad_words") from None


def _encode_plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None,
                    structured: StructuredOutputs | None, vocab_size: int | None = None,
                    defaults: dict[str, Any] | None = None, bad_words: list[list[int]] | None = None,
                    eos_token_ids: tuple[int, ...] | None = None) -> SamplingParams:
    """The request's sampling parameters; those it leaves unset come from `defaults`
    (--generation-config), then SamplingParams' own. Given the vocabulary (and the engine's EOS
    ids), checked for admission here (`checked_params`)."""
    kw: dict[str, Any] = dict(
        logit_bias=_logit_bias(req.logit_bias), allowed_token_ids=_unique(req.allowed_token_ids),
        bad_words_token_ids=bad_words,
        n=req.n, max_tokens=max_tokens, seed=req.seed, stop=req.stop, stop_token_ids=_unique(req.stop_token_ids),
        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        golden_token_ids=req.golden_token_ids, structured_outputs=structured)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logprobs_mode"):
        value = getattr(req, name)
        if value is None:
            value = (defaults or {}).get(name)
        if value is not None:
            kw[name] = value
    try:
        params = SamplingParams(**kw)
        if vocab_size is not None:  # admission's checks, bad-words index and mask tables, made here
            checked_params(params, vocab_size, eos_token_ids)
        return params
    except (ValueError, TypeError, NotImplementedError) as e:
        raise bad_request(f"invalid sampling parameters: {e}", _field_named(str(e))) from None


async def sampling_params_per_prompt(preprocess, req: CompletionRequest | ChatCompletionRequest,
                                     max_tokens: list[int], **kw: Any) -> list[SamplingParams]:
    """`sampling_params` for each prompt's max_tokens, on the preprocessing pool: it checks every id
    and bias the request lists, in Python, which held the event loop (8M allowed_token_ids for 1.2 s;
    a vocabulary's logit_bias 48 ms a prompt, 3 s over 64 prompts). Prompts with one max_tokens share
    one (an engine request's n samples share theirs too)."""
    def build() -> list[SamplingParams]:
        made: dict[int, SamplingParams] = {}
        for mt in max_tokens:
            if mt not in made:
                made[mt] = sampling_params(req, max_tokens=mt, **kw)
        return [made[mt] for mt in max_tokens]
    return await preprocess.run(build)


def _unique(ids: list[int] | None) -> list[int] | None:
    """A token-id set sent as a list (stop_token_ids, allowed_token_ids), each id once: the engine
    checks it at every step of the request (and bans each id while min_tokens holds), so 4 million
    copies of one id made every step of the whole batch seconds long; repeats change nothing it
    does, and 8 million allowed ids were 16 MB to pickle down the engine's pipe."""
    return None if ids is None else list(dict.fromkeys(ids))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids as JSON object keys (strings); their range and the
    biases' ([-100, 100]) are SamplingParams' checks."""
    if not bias:
        return None
    out = {}
    for k, v in bias.items():
        # int() also reads " 1", "1_0", "١", "-0" and "007": each a silent bias on some token
        if not _TOKEN_ID.fullmatch(k):
            raise bad_request(f"logit_bias keys must be token ids written as non-negative decimal integers "
                              f"(ASCII digits, no sign or leading zero, as '42'), got {k[:40]!r}", "logit_bias")
        out[int(k)] = v
    return out


def _field_named(message: str) -> str | None:
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "golden_token_ids", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                 "seed", "stop_token_ids", "stop", "logit_bias", "allowed_token_ids", "structured_outputs", "n",
                 "bad_words"):
        if re.search(rf"\b{name}\b", message):
            return name
    return None

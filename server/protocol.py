"""Request bodies of the OpenAI-compatible API (pydantic, strict types).

Types are strict so that a wrong type is a 400 naming the field, the same
way for every field (a string where a number belongs is an error, not a
silent coercion). Unknown fields are ignored, as `vllm serve` does, except
vLLM's own fields that Detent lacks: those are a 400 (server/vllm_fields.py). The
Detent and vLLM extensions (`top_k`, `min_p`, `golden_token_ids`,
`prompt_logprobs`, `structured_outputs`, `guided_*`, ...) sit beside the
OpenAI fields.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo
from pydantic_core import PydanticCustomError

T = TypeVar("T")
# A list of the wrong items is reported by its first: pydantic builds an error per item, and listing
# the 5M errors of a 20 MB `stop_token_ids: ["a", ...]` took 57 s, holding the GIL (so the event loop)
Items = Annotated[list[T], Field(fail_fast=True)]
MAX_REQUEST_ID_CHARS = 512
Prompt = Union[str, Items[str], Items[int], Items[Items[int]]]


def _bias_size(v: Any, info: ValidationInfo) -> Any:
    """logit_bias's entry count against the vocabulary (the validation context's `vocab_size`, set
    by server/serving.py), before pydantic reads an entry: each key must be a distinct token id, so
    a longer object cannot be valid, and 1M entries held the GIL for seconds in validation."""
    vocab = (info.context or {}).get("vocab_size")
    if vocab is not None and isinstance(v, dict) and len(v) > vocab:
        raise PydanticCustomError("logit_bias_too_long", "{n} entries, more than the model's vocabulary of {vocab} "
                                  "tokens (each key must be a different token id)", {"n": len(v), "vocab": vocab})
    return v


# As Items: an object of wrong values is reported by its first (1M of them stalled /health 2.9 s)
LogitBias = Annotated[dict[str, float], Field(fail_fast=True), BeforeValidator(_bias_size)]

MAX_TOOLS = 128  # OpenAI's on Responses (its 400), which echoes them; chat repeats none and takes more, as vLLM


def _tool_count(v: Any) -> Any:
    """tools past MAX_TOOLS, refused before any tool is read (/v1/responses echoes them:
    200,000 held /health for 1 s)."""
    if isinstance(v, list) and len(v) > MAX_TOOLS:
        raise PydanticCustomError("too_many_tools", "{n} tools, more than OpenAI's limit of {limit}",
                                  {"n": len(v), "limit": MAX_TOOLS})
    return v


Tools = Annotated[Items[dict[str, Any]], BeforeValidator(_tool_count)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True,
                              protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` extension: exactly one constraint."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Items[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Extensions(_Body):
    """The sampling fields /v1/completions, /v1/chat/completions and /v1/responses share:
    OpenAI's and vLLM's extensions. Unknown fields are kept (`model_extra`) so that
    vLLM's fields Detent lacks are refused, not ignored (server/vllm_fields.py)."""
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True, protected_namespaces=())
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | Items[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: Items[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs_mode: Literal["raw", "processed"] | None = None
    golden_token_ids: Items[int] | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Items[str] | None = None
    guided_grammar: str | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    # every response chunk repeats it (as `id`), n x max_tokens times once streaming: bounded, as a
    # response's logprob entries are (an 8 MB id streamed 7.7 GB; UUIDs are 36 characters)
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS)] | None = None
    allowed_token_ids: Items[int] | None = None
    bad_words: Items[str] | None = None


class _Sampling(_Extensions):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | Items[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Items[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Items[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with --reasoning-parser: false leaves `reasoning` out (server/reasoning.py)
    reasoning_effort: str | None = None  # the chat template's variable `reasoning_effort`, as vLLM passes it


class TextFormat(JsonSchemaFormat):
    """Responses' `text.format`: chat's `response_format` with the json_schema fields flat."""
    type: Literal["text", "json_object", "json_schema"]


class ResponseText(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # only "medium" (the default) is honoured


# OpenAI's bounds on a Responses request's metadata: 16 pairs, keys of at most 64 characters, values
# of at most 512. Every response object of the request repeats it (three in a stream, encoded on the
# event loop): 700,000 pairs held /health for 0.9 s while a stream of them was written
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16, fail_fast=True)]
# ... and on the identifiers it repeats: safety_identifier (documented), prompt_cache_key and user
# (OpenAI's 400 "string_above_max_length"), 64 characters each
Identifier = Annotated[str, Field(max_length=64)]


class ReasoningConfig(_Body):
    effort: str | None = None  # passed to the chat template as `reasoning_effort`, as vLLM does
    summary: str | None = None  # refused: the reasoning is returned whole, never summarized
    generate_summary: str | None = None


class ResponsesRequest(_Extensions):
    """OpenAI's Responses API (server/responses_input.py turns it into a chat request).
    `input` items and `tools` are checked there, one by one, so that an unsupported
    item names its index and type."""
    input: str | Items[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    tools: Tools | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: ResponseText | None = None
    include: Items[str] | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None  # accepted; nothing is stored (the response says "store": false)
    metadata: Metadata | None = None
    # calls to built-in tools, of which Detent has none; OpenAI refuses fewer than 1
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    prompt_cache_key: Identifier | None = None  # the prefix cache serves every request without a key
    safety_identifier: Identifier | None = None
    user: Identifier | None = None
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[Items[ChatMessage], Field(min_length=1)] | None = None  # as a chat request's
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Items[dict[str, Any]] | None = None  # given to the chat template, as a chat request's (vLLM's)
    return_token_strs: bool = False  # vLLM's: the tokens' strings beside their ids, as `token_strs`


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Items[int]

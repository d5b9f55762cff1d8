"""Request fields `vllm serve` accepts that Detent does not implement.

A field vLLM accepts is honoured (it is declared in server/protocol.py) or
refused here with a 400 naming it, never silently ignored: a client that
asks for beam search, a cache salt or a priority must learn it did not get
it. A field sent with the value that means "off" (vLLM's default) is
accepted, since clients send defaults. Fields neither side knows are
ignored, as `vllm serve` ignores them.
"""
from __future__ import annotations

from typing import Any

from detent.server.errors import bad_request

_UNSET = (None,)

# field -> the values that ask for nothing (accepted); why it is refused otherwise
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1.0, 1), "length_penalty applies to beam search, which is not implemented"),
    "truncate_prompt_tokens": (_UNSET, "prompts are never truncated: a prompt over the context is a 400"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always decoded with spaces between"),
    "priority": ((None, 0), "requests are served first come, first served (no priority scheduling)"),
    "logits_processors": (_UNSET, "custom logits processors are not supported"),
    "prompt_embeds": (_UNSET, "prompts are token ids or text"),
    "guided_decoding_backend": (_UNSET, "structured output always uses xgrammar"),
    "guided_whitespace_pattern": (_UNSET, "JSON whitespace follows the schema's grammar"),
    "cache_salt": (_UNSET, "the prefix cache is shared; its hits never change a request's bits"),
    "kv_transfer_params": (_UNSET, "KV transfer between instances is not supported"),
    "vllm_xargs": (_UNSET, "vLLM's extra arguments have no meaning here"),
    "return_token_ids": ((None, False), "use logprobs with return_tokens_as_token_ids"),
}
REFUSED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((None, False), "echo is supported on /v1/completions only"),
    "best_of": ((None, 1), "best_of is supported on /v1/completions only (equal to n)"),
    "add_special_tokens": ((None, False), "the chat template places the special tokens"),
    "documents": (_UNSET, "documents for RAG chat templates are not passed to the template"),
    "mm_processor_kwargs": (_UNSET, "the served models are text-only"),
    "parallel_tool_calls": ((None, True), "tool_choice 'required' returns every call the model writes"),
}


# /v1/responses: the fields of vLLM's ResponsesRequest and OpenAI's Responses API that Detent lacks
REFUSED_RESPONSES: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": (_UNSET, "responses are not stored; send the whole conversation as input items"),
    "previous_response": (_UNSET, "responses are not stored; send the whole conversation as input items"),
    "previous_input_messages": (_UNSET, "send the whole conversation as input items"),
    "conversation": (_UNSET, "conversations are not stored; send the whole conversation as input items"),
    "background": ((None, False), "responses are not stored, so they cannot run in the background"),
    "background_options": (_UNSET, "responses are not stored, so they cannot run in the background"),
    "prompt": (_UNSET, "stored prompt templates are not supported; send the input itself"),
    "truncation": ((None, "disabled"), "the input is never truncated: one over the context is a 400"),
    "context_management": (_UNSET, "the input is never compacted or truncated"),
    "parallel_tool_calls": REFUSED_CHAT["parallel_tool_calls"],
    "service_tier": ((None, "auto", "default"), "requests are served first come, first served"),
    "stream_options": ((None, {}, {"include_obfuscation": False}), "stream events are not obfuscated"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache keeps blocks in memory while there is room"),
    "prompt_cache_options": (_UNSET, "the prefix cache is automatic; it takes no breakpoints or TTL"),
    "moderation": (_UNSET, "there is no moderation"),
    "image": (_UNSET, "the served models are text-only"),
    "access_programs": (_UNSET, "there are no access programs"),
    "enable_response_messages": ((None, False), "the rendered prompt is not returned; /v1/tokenize renders it"),
    "priority": REFUSED["priority"],
    "cache_salt": REFUSED["cache_salt"],
    "kv_transfer_params": REFUSED["kv_transfer_params"],
    "vllm_xargs": REFUSED["vllm_xargs"],
    "mm_processor_kwargs": REFUSED_CHAT["mm_processor_kwargs"],
}

COMPLETION_FIELDS = (REFUSED,)
CHAT_FIELDS = (REFUSED, REFUSED_CHAT)
RESPONSES_FIELDS = (REFUSED_RESPONSES,)


def check_vllm_fields(extra: dict[str, Any] | None, tables: tuple[dict[str, tuple[tuple[Any, ...], str]], ...]
                      ) -> None:
    """400 for the first field in the request's unknown fields that asks for something Detent lacks."""
    for table in tables:
        for name, (off, why) in table.items():
            if name in (extra or {}) and not any(extra[name] == v and type(extra[name]) is type(v) or
                                                 extra[name] is v for v in off):
                raise bad_request(f"{name} is not supported by Detent ({why}); got {extra[name]!r}", name)

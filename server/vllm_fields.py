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
    "reasoning_effort": (_UNSET, "reasoning_effort is not passed to the chat template; use chat_template_kwargs"),
    "parallel_tool_calls": ((None, True), "tool_choice 'required' returns every call the model writes"),
}


def check_vllm_fields(extra: dict[str, Any] | None, chat: bool) -> None:
    """400 for the first vLLM field in the request's unknown fields that asks for something Detent lacks."""
    for table in (REFUSED, REFUSED_CHAT) if chat else (REFUSED,):
        for name, (off, why) in table.items():
            if name in (extra or {}) and not any(extra[name] == v and type(extra[name]) is type(v) or
                                                 extra[name] is v for v in off):
                raise bad_request(f"{name} is not supported by Detent ({why}); got {extra[name]!r}", name)

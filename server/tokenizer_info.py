"""GET /tokenizer_info, as `vllm serve` answers it: the tokenizer's configuration
(tokenizer_config.json, file paths left out, added tokens as their text), its
class, and the chat template the server renders with. lm-evaluation-harness
reads it to tokenize and render chats without a local copy of the tokenizer."""
from __future__ import annotations

from typing import Any

from detent.server.errors import APIError


def _plain(v: Any) -> Any:
    """An added token (`{"content": ..., "lstrip": ...}`) as its text, as transformers' init kwargs hold it."""
    if isinstance(v, dict):
        if "content" in v and isinstance(v["content"], str):
            return v["content"]
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    if tokenizer is None:
        raise APIError(404, "this model has no tokenizer (the server takes token ids only)")
    cfg = {k: _plain(v) for k, v in dict(getattr(tokenizer, "config", None) or {}).items()
           if k not in ("vocab_file", "merges_file", "chat_template")}
    cfg["tokenizer_class"] = cfg.get("tokenizer_class") or "PreTrainedTokenizerFast"
    template = getattr(tokenizer, "chat_template", None)
    if template:
        cfg["chat_template"] = template
    return cfg

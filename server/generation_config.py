"""--generation-config: default sampling parameters from a model's
generation_config.json, as `vllm serve` takes them.

"auto" (the default, as vLLM's) reads the file in the model's directory
(the model's under --tokenizer too), "vllm" takes none, a directory reads
its generation_config.json. The values a request does not set come from
it: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens (still capped by the context). A
request's own values always win.
"""
from __future__ import annotations

import json
import os
from typing import Any

from detent.sampling.params import SamplingParams

# generation_config.json key -> request field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(value: str, model_dir: str | None) -> dict[str, Any]:
    """The defaults `value` names ("auto": `model_dir`'s); ValueError (the server refuses to
    start) if the directory or its file is missing or a value is out of SamplingParams' range."""
    if value == "vllm":
        return {}
    if value == "auto":
        if model_dir is None:
            return {}
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(value, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {value!r}: no generation_config.json there "
                             f"(give a directory, 'auto' or 'vllm')")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    out = {KEYS[k]: v for k, v in cfg.items() if k in KEYS and v is not None}
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--generation-config: {path}: {e}") from None
    return out

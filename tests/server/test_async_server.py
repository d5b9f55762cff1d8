"""`detent-serve --async-scheduling` answers exactly as the serial server.

The same requests to two servers over the same tiny model — one planning
each step after the previous one's tokens are on the host, one planning and
launching step N+1 while step N runs — through the official openai client.
Comparator: the response choices (text, token logprobs and top logprobs,
finish reasons) with `==`. Seeded sampling, n = 2, stop strings, logprobs
and a grammar (which makes the async engine collect first) are covered."""
from __future__ import annotations

import openai
import pytest

REQUESTS = [
    ("completions", dict(prompt="Once upon a time", max_tokens=24, temperature=0.8, seed=7, logprobs=3, n=2)),
    ("completions", dict(prompt=["A list:", "Numbers: 1, 2,"], max_tokens=16, temperature=0, stop=[",", "\n"])),
    ("completions", dict(prompt="The weather", max_tokens=1, temperature=0)),
    ("chat", dict(messages=[{"role": "user", "content": "Say hi"}], max_tokens=20, temperature=0.7, seed=3,
                  logprobs=True, top_logprobs=2)),
    ("chat", dict(messages=[{"role": "user", "content": "JSON please"}], max_tokens=24, temperature=0,
                  response_format={"type": "json_object"})),
]


def _choices(base_url: str, api_key: str, kind: str, body: dict) -> list:
    c = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)
    if kind == "completions":
        r = c.completions.create(model="smollm2", **body)
    else:
        r = c.chat.completions.create(model="smollm2", **body)
    return [ch.model_dump() for ch in r.choices]


@pytest.mark.parametrize("kind,body", REQUESTS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(REQUESTS)])
def test_same_choices_as_the_serial_server(server, async_server, api_key, kind, body):
    serial = _choices(server.url, api_key, kind, body)
    overlapped = _choices(async_server.url, api_key, kind, body)
    assert overlapped == serial
    assert all(ch["finish_reason"] in ("stop", "length") for ch in serial)

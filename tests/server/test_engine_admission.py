"""What a served request's admission runs on the engine's step thread. The engine admits requests
between two steps (the core process's step loop; under --no-engine-process, `AsyncEngine`'s
"detent-engine" thread), so work there in the size of what a client sent pauses every running
request. In process, over a real tiny engine in that thread: the server's path, not the model, is
under test."""
from __future__ import annotations

import threading

import pytest
from starlette.testclient import TestClient

from server_helpers import API_KEY

from detent.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STEP_THREAD = "detent-engine"


@pytest.fixture(scope="module")
def client(tiny_model):
    from detent.server.cli import build_state, parse_args
    state = build_state(parse_args(["--model", tiny_model, "--no-engine-process", "--max-model-len", "256",
                                    "--api-key", API_KEY, "--disable-log-stats"]))
    with TestClient(build_app(state)) as c:
        yield c


def _thread_spy(monkeypatch, owner, name: str, seen: dict[str, list[str]]) -> None:
    """Replaces owner.name with a spy that records, per call, the name of the thread it runs on."""
    real, where = getattr(owner, name), seen.setdefault(name, [])

    def spy(*a, **k):
        where.append(threading.current_thread().name)
        return real(*a, **k)
    monkeypatch.setattr(owner, name, spy)


def test_a_served_requests_checks_run_on_the_servers_pool_not_the_engines_step_thread(client, monkeypatch):
    """The engine's admission checked a request's token ids against the vocabulary (`verify_vocab`)
    and its schema against the grammar limits (`check_limits`, twice: admission's and the grammar
    cache's) again, on its step thread, after the server's pool had: a vocabulary's allowed ids,
    bias and stop ids took 9 ms, a legal 64 KB schema 12 ms a walk, a pause of every running
    request. The server's checks stand (`checked_params`): the step thread repeats neither."""
    from detent.engine import admission
    from detent.sampling import grammar, processors
    from detent.sampling.params import SamplingParams
    seen: dict[str, list[str]] = {}
    _thread_spy(monkeypatch, SamplingParams, "verify_vocab", seen)
    for module in (admission, grammar, processors):  # admission's, the grammar cache's, the server's
        _thread_spy(monkeypatch, module, "check_limits", seen)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1,
            "logit_bias": {"5": 1.0}, "stop_token_ids": list(range(100, 4000)),
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}}
    r = client.post("/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    assert seen["verify_vocab"] and seen["check_limits"], seen
    assert not any(STEP_THREAD in where for where in seen.values()), seen


def test_a_served_requests_bad_words_are_indexed_on_the_servers_pool_with_the_same_bits(client, monkeypatch):
    """A request's bad words were indexed at admission, on the engine's step thread: 100k of them
    took 33 ms there, a pause of every running request. The server's pool indexes them and the index
    travels with the params. Its tokens and logprobs are those of the words indexed at admission."""
    from detent.sampling import processors
    from detent.server import params
    body = {"prompt": "hi there", "max_tokens": 6, "seed": 1, "temperature": 1.0, "logprobs": 1}
    plain = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]
    words = [t for t in plain["logprobs"]["tokens"][:3] if t.strip()]
    seen: dict[str, list[str]] = {}
    _thread_spy(monkeypatch, processors.BadWords, "__init__", seen)  # the index's build
    r = client.post("/v1/completions", headers=AUTH, json={**body, "bad_words": words})
    assert r.status_code == 200, r.text
    assert seen["__init__"] and STEP_THREAD not in seen["__init__"], seen
    monkeypatch.setattr(params, "checked_params", lambda p, vocab_size, *eos: p.verify_vocab(vocab_size))
    at_admission = client.post("/v1/completions", headers=AUTH, json={**body, "bad_words": words}).json()
    assert seen["__init__"][-1] == STEP_THREAD  # built by the engine, as before
    got, want = r.json()["choices"][0], at_admission["choices"][0]
    assert got["logprobs"] == want["logprobs"] and got["text"] == want["text"] != plain["text"]


def test_a_served_requests_mask_tables_and_grammar_key_are_made_on_the_servers_pool(client, monkeypatch):
    """The engine's step thread built a request's mask tables (a vocabulary's allowed ids, bias and
    stop ids: 14 ms with the check that they leave some token) and its spec's grammar-cache key once
    a sample (a legal 64 KB schema's: 69 ms for n = 128), a pause of every running request. The
    server's pool makes both, with the engine's EOS ids (EngineLimits.eos_token_ids), and refuses
    there a request whose bans leave no token, naming the field."""
    from detent.sampling import processors
    from detent.sampling.params import StructuredOutputs
    seen: dict[str, list[str]] = {}
    _thread_spy(monkeypatch, processors, "build_mask_ids", seen)
    _thread_spy(monkeypatch, StructuredOutputs, "key", seen)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1, "n": 2, "min_tokens": 1,
            "logit_bias": {"5": 1.0}, "allowed_token_ids": list(range(100, 4000)), "stop_token_ids": [7, 8],
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}}
    r = client.post("/v1/chat/completions", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    assert seen["build_mask_ids"] and seen["key"], seen
    assert not any(STEP_THREAD in where for where in seen.values()), seen
    seen.clear()
    r = client.post("/v1/chat/completions", headers=AUTH, json={**body, "allowed_token_ids": [7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert "no token can be sampled" in r.json()["error"]["message"]
    assert not any(STEP_THREAD in where for where in seen.values()), seen


def test_a_served_prompt_is_hashed_on_the_servers_pool_with_the_same_hashes(client, monkeypatch):
    """Admission hashed a prompt's full blocks for the prefix cache on the engine's step thread: a
    32k-token prompt's took 6.4 ms there, a pause of every running request. The server's pool hashes
    it for the engine's block size (EngineLimits.block_size) and its hashes travel with it
    (`HashedPrompt`): the step thread takes them. They are the engine's own: a repeat hits the cache."""
    from detent.scheduler import request as R
    real, made, where = R.hash_blocks, [], []

    def spy(ids, *a, **k):
        if "start_block" not in k:  # a prompt's (an output's blocks are hashed as they fill)
            where.append(threading.current_thread().name)
        return real(ids, *a, **k)
    monkeypatch.setattr(R, "hash_blocks", spy)
    init = R.Request.__init__
    monkeypatch.setattr(R.Request, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
    prompt = [100 + 7 * i for i in range(150)]
    for _ in range(2):
        r = client.post("/v1/completions", headers=AUTH, json={"prompt": prompt, "max_tokens": 2, "n": 2})
        assert r.status_code == 200, r.text
    assert len(made) == 4 and STEP_THREAD not in where, where
    bs = made[0].block_size
    assert all(q.block_hashes[:len(prompt) // bs] == real(prompt, bs) for q in made)
    assert made[2].num_cached_tokens == len(prompt) // bs * bs

"""`detent-serve --rl --allowed-weight-dir DIR`: unseeded or greedy requests
get a 400 naming the field; `POST /v1/update_weights` is behind the API key,
reads only inside DIR, refuses a checkpoint that does not fit (400, naming
the tensor) and otherwise swaps the weights: outputs change, and loading the
original checkpoint back gives the original outputs bit for bit."""
from __future__ import annotations

import os
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from server_helpers import API_KEY, launch, real_argv

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def rl_server(tiny_model, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    w = load_file(os.path.join(tiny_model, "model.safetensors"))
    os.makedirs(allowed / "orig")
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), allowed / "orig" / "model.safetensors")
    save_file({n: (t * 1.5 if "mlp" in n else t) for n, t in w.items()}, str(allowed / "new.safetensors"))
    save_file({**w, "model.norm.weight": torch.ones(3)}, str(allowed / "bad.safetensors"))
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "256", "--rl",
                          "--allowed-weight-dir", str(allowed))) as s:
        yield s, allowed


def _complete(url, **kw):
    body = {"prompt": "Hello there", "max_tokens": 8, "logprobs": 1, "temperature": 1.0, "seed": 3, **kw}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def _update(url, path, headers=AUTH):
    return httpx.post(url + "/v1/update_weights", json={"path": str(path)}, headers=headers, timeout=60)


def _bits(r):
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def test_rl_mode_refuses_unseeded_and_greedy_requests(rl_server):
    s, _ = rl_server
    body = {"prompt": "Hi", "max_tokens": 2}
    r = httpx.post(s.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    r = httpx.post(s.url + "/v1/completions", json={**body, "seed": 1, "temperature": 0}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    assert _complete(s.url).status_code == 200


def test_update_weights_route(rl_server, tiny_model):
    s, allowed = rl_server
    before = _bits(_complete(s.url))
    assert _update(s.url, allowed / "new.safetensors", headers={}).status_code == 401
    r = _update(s.url, tiny_model)
    assert r.status_code == 403 and "allowed" in r.json()["error"]["message"]
    r = _update(s.url, allowed / ".." / os.path.basename(tiny_model))  # no escaping with ..
    assert r.status_code == 403
    r = _update(s.url, allowed / "missing")
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    r = _update(s.url, allowed / "bad.safetensors")
    assert r.status_code == 400 and "model.norm.weight: shape [3]" in r.json()["error"]["message"]
    assert _bits(_complete(s.url)) == before  # refused: nothing changed
    r = _update(s.url, allowed / "new.safetensors")
    assert r.status_code == 200, r.text
    assert r.json()["num_tensors"] > 10
    assert _bits(_complete(s.url)) != before
    assert _update(s.url, allowed / "orig").status_code == 200
    assert _bits(_complete(s.url)) == before

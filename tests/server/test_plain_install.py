"""Every import a request can reach is a runtime dependency (issue 23, item 2).

The session server runs under plain_install.py: only the closure of
pyproject's `dependencies` can be imported. A JSON-schema request needs
`jsonschema`, which was a test extra: it answered 500 "No module named
'jsonschema'" from a plain `pip install -e .`.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server_helpers import API_KEY
from plain_install import blocked_modules, project_requirements, runtime_closure

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def test_the_plain_install_blocks_test_extras_but_not_runtime_deps():
    blocked = set(blocked_modules(runtime_closure(project_requirements())))
    assert {"pytest", "hypothesis", "openai"} <= blocked  # the test extras are really unimportable
    assert not {"jsonschema", "xgrammar", "fastapi", "torch"} & blocked


def test_the_server_runs_as_a_plain_install(server):
    line = next(ln for ln in server.output().splitlines() if ln.startswith("plain_install:"))
    assert "pytest" in line and "hypothesis" in line


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    {"guided_json": SCHEMA},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_json_schema_request_from_a_plain_install(server, extra):
    body = {"messages": [{"role": "user", "content": "a number"}], "max_tokens": 24, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a random tiny model may run out of tokens first
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)

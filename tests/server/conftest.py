"""The server tests' fixtures: real `detent-serve` processes (server_helpers.py)."""
from __future__ import annotations

import os

import pytest

from server_helpers import API_KEY, launch, make_tiny_model, real_argv


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def server(tiny_model):
    """`detent-serve` on a tiny random Llama (real engine and tokenizer), with an API key."""
    extra = os.environ.get("DETENT_TEST_SERVER_ARGS", "").split()
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024", "--max-num-seqs", "32",
                          "--max-request-bytes", "1000000", "--served-model-name", "smollm2", "detent-smollm2",
                          "--request-timeout", "3", *extra)) as s:
        yield s


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def async_server(tiny_model):
    """The same server with async scheduling forced on (CPU default: off)."""
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024", "--max-num-seqs", "32",
                          "--max-request-bytes", "1000000", "--served-model-name", "smollm2",
                          "--async-scheduling")) as s:
        yield s


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient_factory(server):
    import openai
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

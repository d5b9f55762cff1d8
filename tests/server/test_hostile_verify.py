"""POST /v1/verify under a hostile-client campaign: records that are not objects, over the
record limit, over the generation routes' bounds, or that the engine would refuse at admission,
each with the 400 expected now. In process, over the fake engine with a fingerprint: the route's
checks, not the model, are under test."""
from __future__ import annotations

import pytest
from fake_engine import FakeEngine, FakeTokenizer, fake_state
from starlette.testclient import TestClient

from server_helpers import API_KEY, client_error as _error

from detent.engine.fingerprint import Fingerprint
from detent.server.app import build_app
from detent.server.serving import ServerState

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _state(engine, **kw) -> ServerState:
    return fake_state(engine, api_key=API_KEY, engine_fingerprint=Fingerprint("a" * 64, "b" * 64), **kw)


@pytest.fixture(scope="module")
def verifier():
    """The app over the fake engine with a fingerprint, so POST /v1/verify parses and judges records
    (every record below ran under another selection: refused, never run)."""
    with TestClient(build_app(_state(FakeEngine()))) as c:
        yield c


def _record(**params) -> dict:
    return {"format": "detent-request-log/1", "type": "request", "request_id": "r", "prompt_token_ids": [5, 6],
            "selection": "stock", "tuple_hash": "a" * 64, "deployment_hash": "b" * 64,
            "params": {"max_tokens": 2, "temperature": 0, **params},
            "outputs": [{"token_ids": [7, 8], "finish_reason": "length"}]}


def test_verify_bounds_a_records_spec_and_stop_strings_as_a_request(verifier):
    """POST /v1/verify parsed a record's params on the event loop with no bound on its
    structured-output spec: a 2.4 MB schema spent 11 s in jsonschema there, and /health waited
    11 s. The spec now has the generation routes' size bound (64 KiB, before it is validated;
    the parse runs on the preprocessing pool) and the stop strings their character bound."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}  # ~90 KB
    r = verifier.post("/v1/verify", headers=AUTH, json=_record(structured_outputs={"json": big}))
    err = _error(r)
    assert err["param"] == "params.structured_outputs.json" and "max_spec_bytes" in err["message"], err
    err = _error(verifier.post("/v1/verify", headers=AUTH, json=_record(stop=[f"s{i}" for i in range(10_000)])))
    assert err["param"] == "params.stop" and "--max-chars-per-token" in err["message"], err
    small = {"type": "object", "properties": {"a": {"type": "string"}}}
    r = verifier.post("/v1/verify", headers=AUTH, json=_record(structured_outputs={"json": small}, stop=["x"]))
    assert r.status_code == 200 and r.json()["counts"]["refused"] == 1, r.text


@pytest.mark.parametrize("body", [[1], [None], ["x"], [[_record()]], 5])
def test_verify_refuses_a_record_that_is_not_an_object(verifier, body):
    """`[1]` was a 500 (AttributeError: the spec-size check read .get of an int); a record that is
    not an object is a 400 naming it, as parse_record words it."""
    err = _error(verifier.post("/v1/verify", headers=AUTH, json=body))
    assert "object" in err["message"], err


def test_verify_counts_its_records_before_parsing_any(verifier, monkeypatch):
    """Parsing a record validates its parameters and spec (jsonschema's meta-schema, in Python): 297
    records of 56 KB schemas, over --max-verify-records (16), spent 56 s on the preprocessing pool,
    all parsed, before the 400 that counted them. The count comes first; server records are not
    counted, and a body within the limit is parsed as before."""
    import detent.server.verify as verify
    parsed = []
    real = verify.parse_record
    monkeypatch.setattr(verify, "parse_record", lambda item: parsed.append(item) or real(item))
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    records = [_record(structured_outputs={"json": schema}) for _ in range(17)]
    err = _error(verifier.post("/v1/verify", headers=AUTH, json=records))
    assert "17 request records in one body, over the limit of 16" in err["message"], err
    assert parsed == [], len(parsed)
    server = {"format": "detent-request-log/1", "type": "server", "tuple_hash": "h", "tuple": {}}
    r = verifier.post("/v1/verify", headers=AUTH, json=[server] * 20 + records[:16])
    assert r.status_code == 200 and r.json()["counts"]["refused"] == 16 and len(parsed) == 16, r.text


@pytest.mark.parametrize("params,field,needle", [
    ({"bad_words_token_ids": [[5], [10 ** 6]]}, "params.bad_words_token_ids", "contains token id 1000000"),
    ({"allowed_token_ids": [10 ** 6]}, "params.allowed_token_ids", "contains token id 1000000"),
    ({"logit_bias": {"1000000": 1.0}}, "params.logit_bias", "contains token id 1000000"),
    ({"structured_outputs": {"json": {"$ref": "http://example.com/s.json"}}}, "params.structured_outputs.json",
     "names another document"),
])
def test_verify_names_the_records_field_the_engine_would_refuse(params, field, needle):
    """A record the engine refuses at admission (an id outside the vocabulary, a spec over its grammar
    limits) was a 400 naming the generation routes' field (bad_words, structured_outputs), no record,
    once the records before it were admitted (then aborted). It is a 400 naming the record and its
    params' field before anything runs; a record that is refused anyway (another selection) is
    reported, not a 400."""
    from detent.engine import check_limits

    class Counting(FakeEngine):  # refuses at admission as LLMEngine.add_request does
        added = 0

        def add_request(self, request_id, prompt_token_ids, params):
            params.verify_vocab(self.vocab_size)
            if params.structured_outputs is not None:
                check_limits(params.structured_outputs)
            Counting.added += 1
            return super().add_request(request_id, prompt_token_ids, params)

    state = _state(Counting(), vocab_size=FakeTokenizer.vocab_size)
    good, bad = ({**_record(**p), "selection": "pinned", "request_id": rid} for rid, p in (("ok", {}), ("r", params)))
    with TestClient(build_app(state)) as c:
        err = _error(c.post("/v1/verify", headers=AUTH, json=[good, bad]))
        assert err["param"] == field and err["message"].startswith(f"record 1 (r): {field}"), err
        assert needle in err["message"] and Counting.added == 0, err
        r = c.post("/v1/verify", headers=AUTH, json=[good, {**bad, "selection": "stock"}])
        assert r.status_code == 200 and r.json()["counts"]["refused"] == 1 and Counting.added == 1, r.text


@pytest.mark.parametrize("stop,got", [(5, "int"), ({"ab": 1}, "dict"), (True, "bool")])
def test_verify_names_a_records_stop_that_is_not_strings(verifier, stop, got):
    """A record's params reach SamplingParams unchecked by pydantic: `stop: 5` was a 400 saying
    "'int' object is not iterable", and `stop: {"ab": 1}` was taken as the stop string "ab" (a
    dict's keys). Both are a 400 saying what stop must be."""
    err = _error(verifier.post("/v1/verify", headers=AUTH, json=_record(stop=stop)))
    assert f"stop must be a string or a list of non-empty strings, got {got}" in err["message"], err
    r = verifier.post("/v1/verify", headers=AUTH, json=_record(stop=["ab"]))
    assert r.status_code == 200, r.text


def test_verify_names_an_unknown_structured_output_field_in_a_record(verifier):
    """A record's `structured_outputs: {"foo": 1}` was a 400 quoting Python: "StructuredOutputs.__init__()
    got an unexpected keyword argument 'foo'". It names the field and the ones there are."""
    err = _error(verifier.post("/v1/verify", headers=AUTH, json=_record(structured_outputs={"regex": "a", "foo": 1})))
    assert "structured_outputs.foo is not a structured-output field" in err["message"], err
    assert "__init__" not in err["message"], err

"""Request-log records and their re-execution, in process (engine/log_record.py,
engine/replay.py, detent/verify_log.py) on the tiny Llama (fp32, CPU).

A co-batched workload is recorded as `detent-serve --request-log` records it,
written to JSON and read back, then re-executed one request at a time on a
fresh engine: under pinned every record is equal (`==` on token ids and
every logprob entry); under stock, the same check finds differences, so it
can fail."""
from __future__ import annotations

import copy
import json
import math

import pytest

from detent.engine import (RecordError, SamplingParams, compare_output, parse_record, refusal_reason,
                           request_record, skip_reason)
from detent.engine.log_record import params_json
from detent.selection import deployment_hash
from detent.verify_log import verify_log
from engine_helpers import bundle, make_llm, prompt

VOCAB = 160


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed lengths and parameters: greedy, seeded and unseeded sampling, n=2, prompt logprobs."""
    prompts, params = [], []
    for i in range(10):
        prompts.append(prompt(100 + i, [7, 60, 23, 90, 3, 41, 12, 75, 30, 55][i], VOCAB))
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=10, logprobs=3,
                                         ignore_eos=True))
        elif kind == 2:  # unseeded: the engine draws the seed, the record keeps it
            params.append(SamplingParams(temperature=1.0, top_k=40, n=2, max_tokens=8, logprobs=2,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.5, seed=i, max_tokens=6, logprobs=1, prompt_logprobs=2,
                                         repetition_penalty=1.1, ignore_eos=True))
    return prompts, params


def _recorded(selection: str) -> tuple[list, object]:
    """The workload run co-batched (one generate call, step budget 32), as JSON records read back."""
    llm = make_llm(bundle("llama"), selection, max_num_batched_tokens=32, max_model_len=512)
    prompts, params = _workload()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    fp = llm.llm_engine.fingerprint()
    lines = [json.dumps(request_record(request_id=f"r{i}", endpoint="/v1/completions", model="tiny", fp=fp,
                                       prompt=None, prompt_token_ids=p, params=sp, output=o, arrival=0.0,
                                       finished=1.0))
             for i, (p, sp, o) in enumerate(zip(prompts, params, outs))]
    return [parse_record(json.loads(line)) for line in lines], fp


@pytest.fixture(scope="module")
def pinned_records():
    return _recorded("pinned")


def _replay(selection: str, records: list) -> list:
    llm = make_llm(bundle("llama"), selection, max_num_batched_tokens=32, max_model_len=512)
    return verify_log(llm, records, {}, batch=1)  # each alone: other neighbours than when recorded


def test_pinned_records_re_execute_bit_for_bit(pinned_records):
    records, _ = pinned_records
    assert {r.raw["seed_given"] for r in records} == {True, False}  # unseeded requests record the drawn seed
    findings = _replay("pinned", records)
    assert [f.status for f in findings] == ["equal"] * len(records), [f.to_json() for f in findings]


def test_stock_records_differ_when_re_executed_alone():
    records, _ = _recorded("stock")
    findings = _replay("stock", records)
    different = [f for f in findings if f.status == "different"]
    assert different, "stock re-executed alone matched its co-batched run: verify could not fail"
    assert all(d["recorded"] != d["replayed"] for f in different for d in f.differences)


def test_a_tampered_logprob_is_the_first_difference(pinned_records):
    records, _ = pinned_records
    rec = records[1]
    raw = copy.deepcopy(rec.raw)
    lp = raw["outputs"][0]["logprobs"][4][0]
    lp[1] = math.nextafter(lp[1], 0.0)  # one ulp
    out = _generate_one(rec)
    assert compare_output(rec, out).status == "equal"
    f = compare_output(parse_record(raw), out)
    assert f.status == "different"
    (d,) = f.differences
    assert (d["sample"], d["token_index"]) == (0, 4)
    assert d["recorded"]["logprobs"][0][1] == lp[1] != d["replayed"]["logprobs"][0][1]
    assert d["recorded"]["token_id"] == d["replayed"]["token_id"] == raw["outputs"][0]["token_ids"][4]


def test_a_tampered_token_and_a_missing_token_are_found(pinned_records):
    records, _ = pinned_records
    rec = records[0]
    out = _generate_one(rec)
    raw = copy.deepcopy(rec.raw)
    raw["outputs"][0]["token_ids"][7] = (raw["outputs"][0]["token_ids"][7] + 1) % VOCAB
    (d,) = compare_output(parse_record(raw), out).differences
    assert d["token_index"] == 7
    raw = copy.deepcopy(rec.raw)
    raw["outputs"][0]["token_ids"].pop()
    raw["outputs"][0]["logprobs"].pop()
    (d,) = compare_output(parse_record(raw), out).differences
    assert d["token_index"] == 11 and d["recorded"]["token_id"] is None


def _generate_one(rec):
    llm = make_llm(bundle("llama"), "pinned", max_num_batched_tokens=32, max_model_len=512)
    return llm.generate([{"prompt_token_ids": rec.prompt_token_ids}], rec.params, use_tqdm=False)[0]


def test_refusals_name_what_differs(pinned_records):
    records, fp = pinned_records
    rec = records[0]
    assert refusal_reason(rec, fp) is None
    raw = copy.deepcopy(rec.raw)
    raw["facts"]["max_context"] = 4096
    raw["deployment_hash"] = deployment_hash(raw["facts"])
    why = refusal_reason(parse_record(raw), fp)
    assert "deployment fact 'max_context' differs: the request ran with 4096, this deployment has 512" in why
    raw["facts"]["max_num_seqs"] = 7  # facts edited without their hash
    assert "do not hash to its deployment_hash" in refusal_reason(parse_record(raw), fp)

    raw = copy.deepcopy(rec.raw)
    raw["tuple_hash"] = "f" * 64
    assert "tuple_hash differs" in refusal_reason(parse_record(raw), fp)
    theirs = copy.deepcopy(fp.tuple)
    theirs["families"]["attention"]["pins"]["split_tokens"] = 128
    why = refusal_reason(parse_record(raw), fp, {"f" * 64: theirs})
    assert "tuple attention.pins.split_tokens differs: 128 in the request's tuple, 256 here" in why

    raw = copy.deepcopy(rec.raw)
    raw["selection"] = "stock"
    assert "selection differs: the request ran under 'stock'" in refusal_reason(parse_record(raw), fp)


def test_aborted_requests_are_skipped(pinned_records):
    raw = copy.deepcopy(pinned_records[0][0].raw)
    raw["outputs"][0]["finish_reason"] = "abort"
    assert "did not run to its end" in skip_reason(parse_record(raw))


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.pop("prompt_token_ids"), "prompt_token_ids"),
    (lambda r: r.update(prompt_token_ids=[]), "prompt_token_ids"),
    (lambda r: r.update(prompt_token_ids=[1, "2"]), "prompt_token_ids"),
    (lambda r: r.update(format="x"), "format"),
    (lambda r: r.update(type="server"), "type"),
    (lambda r: r["params"].update(temperature=-1), "params"),
    (lambda r: r["params"].update(bogus=1), "params.bogus"),
    (lambda r: r["params"].update(seed=None), "params.seed"),
    (lambda r: r.update(tuple_hash=5), "tuple_hash"),
    (lambda r: r.update(outputs=[]), "outputs"),
    (lambda r: r["outputs"][0]["logprobs"][0].append([1, "x", 1]), "outputs[0].logprobs[0]"),
    (lambda r: r["outputs"][0]["logprobs"].pop(), "outputs[0].logprobs"),
    (lambda r: r["outputs"][0].update(token_ids=[True]), "outputs[0].token_ids"),
])
def test_malformed_records_name_the_field(pinned_records, edit, field):
    raw = copy.deepcopy(pinned_records[0][1].raw)  # a seeded sampled record
    edit(raw)
    with pytest.raises(RecordError) as e:
        parse_record(raw)
    assert e.value.field == field


def test_params_round_trip_through_json():
    from detent.sampling.params import StructuredOutputs
    cases = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.2, seed=-3, max_tokens=9, min_tokens=2,
                       stop=["ab", "c"], stop_token_ids=[4], include_stop_str_in_output=True, ignore_eos=True,
                       logprobs=3, prompt_logprobs=1, logprobs_mode="processed", golden_token_ids=[5, 6],
                       skip_special_tokens=False, logit_bias={7: -2.5, 8: 100.0}, allowed_token_ids=[5, 6, 7, 8],
                       bad_words_token_ids=[[9], [10, 11]], n=3),
        SamplingParams(structured_outputs=StructuredOutputs(json={"type": "object"}), seed=2**64 - 1),
        SamplingParams(structured_outputs=StructuredOutputs(choice=["yes", "no"])),
        SamplingParams(structured_outputs=StructuredOutputs(regex="[a-z]+", start_after_token_ids=[151668])),
    ]
    for p in cases:
        back = SamplingParams(**json.loads(json.dumps(params_json(p, p.seed))))
        assert back == p
    assert SamplingParams(**json.loads(json.dumps(params_json(SamplingParams(), 42)))).seed == 42


def test_read_log_names_bad_lines_and_leaves_out_an_unfinished_last_one(pinned_records, tmp_path):
    from detent.engine import Finding
    from detent.verify_log import read_log
    records, fp = pinned_records
    good = json.dumps(records[0].raw)
    server = json.dumps({"type": "server", "tuple_hash": fp.tuple_hash, "tuple": fp.tuple})
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join([server, good, good[:40] + "{", '{"type": "request"}', good, good[:50]]))
    got, tuples, notes = read_log(str(path))
    assert tuples == {fp.tuple_hash: fp.tuple}
    assert [type(x).__name__ for x in got] == ["Record", "Finding", "Finding", "Record"]
    assert isinstance(got[1], Finding) and "line 3 is not JSON" in got[1].reason
    assert "line 4 is not a request record: format" in got[2].reason
    assert notes == ["line 6: an unfinished last line (the server stopped while writing it), left out"]


def test_read_log_leaves_out_a_server_record_whose_tuple_is_malformed(pinned_records, tmp_path):
    """A hand-edited server record's tuple is walked to name differing pins: one whose parts
    are not objects is a note, not a crash of `detent verify`, and the record it would have
    named is refused without pins."""
    from detent.engine import refusal_reason
    from detent.verify_log import read_log
    records, fp = pinned_records
    other = {**records[0].raw, "tuple_hash": "f" * 16}
    path = tmp_path / "log.jsonl"
    bad = {"type": "server", "tuple_hash": "f" * 16, "tuple": {"families": {"gemm": {"pins": [1]}}}}
    path.write_text("\n".join([json.dumps(bad), json.dumps(other)]) + "\n")
    got, tuples, notes = read_log(str(path))
    assert tuples == {} and notes == ["line 1: a server record whose tuple is malformed "
                                      "(tuple.families.gemm.pins: must be an object, got list), left out"]
    assert "no server record of the log holds that tuple" in refusal_reason(got[0], fp, tuples)


def test_non_finite_logprobs_round_trip_as_strings():
    """logprobs_mode="processed" reports -inf for the tokens top-k masked: the record writes
    "-inf" (JSON has no infinity), reads it back, and compares it equal to a re-execution."""
    llm = make_llm(bundle("llama"), "pinned", max_num_batched_tokens=32, max_model_len=512)
    p = SamplingParams(temperature=1.0, top_k=2, seed=5, max_tokens=6, logprobs=5, logprobs_mode="processed",
                       ignore_eos=True)
    ids = prompt(7, 20, VOCAB)
    out = llm.generate([{"prompt_token_ids": ids}], p, use_tqdm=False)[0]
    line = json.dumps(request_record(request_id="r", endpoint="", model="tiny", fp=llm.llm_engine.fingerprint(),
                                     prompt=None, prompt_token_ids=ids, params=p, output=out, arrival=0.0,
                                     finished=0.0), allow_nan=False)
    rec = parse_record(json.loads(line))
    assert "-inf" in [e[1] for pos in rec.raw["outputs"][0]["logprobs"] for e in pos]
    again = llm.generate([{"prompt_token_ids": ids}], rec.params, use_tqdm=False)[0]
    assert compare_output(rec, again).status == "equal"

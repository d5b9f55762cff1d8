"""The commitment tuple: format, validation errors, default tuple, hashes."""
import json

import pytest

from detent.selection import CommitmentTuple, TupleError, default_tuple, deployment_hash, tuple_hash
from detent.selection.facts import default_facts_for

CFG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
       "vocab_size": 100}


@pytest.fixture(scope="module")
def facts():
    return default_facts_for(CFG, max_context=1024, max_num_batched_tokens=2048, max_num_seqs=32)


@pytest.fixture(scope="module")
def tup(facts):
    return default_tuple(facts)


def test_default_tuple_values(tup, facts):
    assert tup.families["gemm"] == {"pins": {}, "knobs": {"chunk": 16}, "sites": {}}
    assert tup.families["attention"]["pins"] == {"split_tokens": 256}
    assert tup.families["attention"]["knobs"] == {"split_stride": 256}
    assert "norm" not in tup.families  # no pins, no knobs
    tup.validate(facts)


def test_roundtrip_and_hashes(tup, facts, tmp_path):
    path = tmp_path / "t.json"
    tup.save(str(path))
    back = CommitmentTuple.load(str(path))
    assert back.families == tup.families and back.facts == facts
    assert tuple_hash(back) == tuple_hash(tup) == back.hash
    d = json.loads(path.read_text())
    assert d["format"] == "detent-tuple/1" and d["deployment"]["hash"] == deployment_hash(facts)
    assert len(deployment_hash(facts)) == 64
    other = dict(facts, tp=2)
    assert deployment_hash(other) != deployment_hash(facts)


def _write(tmp_path, d):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d) if not isinstance(d, str) else d)
    return str(p)


def test_errors_name_what_is_wrong(tup, facts, tmp_path):
    with pytest.raises(TupleError, match=r"t.json: malformed JSON at line 1 column \d+"):
        CommitmentTuple.load(_write(tmp_path, "{nope"))
    d = tup.to_dict()
    with pytest.raises(TupleError, match="field 'format'"):
        CommitmentTuple.load(_write(tmp_path, {**d, "format": "x"}))
    bad = json.loads(json.dumps(d))
    bad["families"]["warp_drive"] = {"pins": {}}
    with pytest.raises(TupleError, match="unknown family 'warp_drive'"):
        CommitmentTuple.load(_write(tmp_path, bad))
    t = CommitmentTuple.load(_write(tmp_path, d))
    with pytest.raises(TupleError, match="deployment fact 'max_context' differs: the tuple was made for 1024, "
                                         "this deployment has 2048"):
        t.validate(dict(facts, max_context=2048))
    edited = json.loads(json.dumps(d))
    edited["deployment"]["facts"]["tp"] = 4
    with pytest.raises(TupleError, match="deployment.hash"):
        CommitmentTuple.load(_write(tmp_path, edited))
    ill = json.loads(json.dumps(d))
    ill["families"]["attention"]["pins"]["split_tokens"] = 24
    t = CommitmentTuple.load(_write(tmp_path, ill))
    with pytest.raises(TupleError) as e:
        t.validate(facts)
    msg = str(e.value)
    assert "family 'attention'" in msg and "pin 'split_tokens' = 24" in msg and "legal values: [" in msg
    ill = json.loads(json.dumps(d))
    ill["families"]["gemm"]["knobs"]["chunk"] = 8
    with pytest.raises(TupleError, match=r"family 'gemm'.*knob 'chunk' = 8 is not one of \[1, 16\]"):
        CommitmentTuple.load(_write(tmp_path, ill)).validate(facts)
    unk = json.loads(json.dumps(d))
    unk["families"]["attention"]["pins"]["splits"] = 3
    with pytest.raises(TupleError, match="unknown pin or knob 'splits'"):
        CommitmentTuple.load(_write(tmp_path, unk)).validate(facts)


def test_site_overrides_apply_to_one_site(tup, facts):
    from detent.selection.facts import site_key, sites_for
    t = CommitmentTuple(facts, json.loads(json.dumps(tup.families)))
    s0, s1 = sites_for(facts, "gemm")[:2]
    t.families["gemm"]["sites"] = {site_key(s0): {"knobs": {"chunk": 1}}}
    assert t.assignment_for("gemm", s0) == {"chunk": 1}
    assert t.assignment_for("gemm", s1) == {"chunk": 16}
    t.validate(facts)

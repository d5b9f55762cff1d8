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


def _edited(tup, edit):
    d = json.loads(json.dumps(tup.to_dict()))
    edit(d["families"])
    return d


def _set(family, part, name, value):
    def edit(fams):
        fams[family][part][name] = value
    return edit


REFUSED = {  # edit -> what the message must name
    "split_tokens_0": (_set("attention", "pins", "split_tokens", 0), r"pin 'split_tokens' = 0 is not one of its "
                       r"legal values: \[16, 32, 48"),
    "split_tokens_negative": (_set("attention", "pins", "split_tokens", -256), r"pin 'split_tokens' = -256"),
    "split_tokens_huge": (_set("attention", "pins", "split_tokens", 10 ** 30), r"pin 'split_tokens' = 10000000000"),
    "split_tokens_float": (_set("attention", "pins", "split_tokens", 256.0), r"pin 'split_tokens' = 256.0 is not one"),
    "split_tokens_str": (_set("attention", "pins", "split_tokens", "256"), r"pin 'split_tokens' = '256' is not one"),
    "split_tokens_bool": (_set("attention", "pins", "split_tokens", True), r"pin 'split_tokens' = True is not one"),
    "split_tokens_list": (_set("attention", "pins", "split_tokens", [256]), r"pin 'split_tokens' = \(256,\)"),
    "chunk_huge": (_set("gemm", "knobs", "chunk", 10 ** 30), r"knob 'chunk' = 10{30} is not one of \[1, 16\]"),
    "chunk_zero": (_set("gemm", "knobs", "chunk", 0), r"knob 'chunk' = 0 is not one of \[1, 16\]"),
    "chunk_bool": (_set("gemm", "knobs", "chunk", True), r"knob 'chunk' = True is not one of \[1, 16\]"),
    "stride_str": (_set("attention", "knobs", "split_stride", "x"), r"knob 'split_stride' = 'x' is not one of"),
    "gemm_deleted": (lambda f: f.pop("gemm"), r"no entry for family 'gemm'.*knobs: \['chunk'\]"),
    "attention_deleted": (lambda f: f.pop("attention"), r"no entry for family 'attention'.*pins: \['split_tokens'\]"),
    "pin_deleted": (lambda f: f["attention"]["pins"].pop("split_tokens"), r"family 'attention'.*no value for pin "
                    r"'split_tokens'"),
    "knob_deleted": (lambda f: f["attention"]["knobs"].pop("split_stride"), r"no value for knob 'split_stride'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_every_value_is_checked_at_startup(tup, facts, tmp_path, case):
    """A tuple that could fail at run time (ZeroDivisionError, a TypeError in a selector) or that
    relies on defaults is refused when the engine starts, naming the family, the pin and its legal values."""
    from detent.selection import make_dispatcher
    edit, want = REFUSED[case]
    path = _write(tmp_path, _edited(tup, edit))
    with pytest.raises(TupleError, match=want):
        make_dispatcher(facts, "pinned", path)
    make_dispatcher(facts, "pinned", _write(tmp_path, tup.to_dict()))  # the unedited tuple starts


@pytest.mark.parametrize("where", ["text", "pin", "facts"])
def test_deep_json_is_a_tuple_error(tup, tmp_path, where):
    deep = "[" * 100_000 + "]" * 100_000
    if where == "text":
        text = deep
    else:
        d = tup.to_dict()
        marker = '"__deep__"'
        if where == "pin":
            d["families"]["attention"]["pins"]["split_tokens"] = "__deep__"
        else:
            d["deployment"]["facts"]["x"] = "__deep__"
        text = json.dumps(d).replace(marker, "[" * 500 + "]" * 500)
    with pytest.raises(TupleError, match="nested"):
        CommitmentTuple.load(_write(tmp_path, text))


def test_a_nested_pin_value_is_refused_with_its_path(tup, tmp_path):
    d = _edited(tup, _set("attention", "pins", "split_tokens", {"a": 1}))
    with pytest.raises(TupleError, match=r"families.attention.pins.split_tokens: a pin or knob value is a number"):
        CommitmentTuple.load(_write(tmp_path, d))

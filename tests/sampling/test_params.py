"""SamplingParams / StructuredOutputs validation: every bad value names its field and range."""
from __future__ import annotations

import pytest

from detent.sampling.params import SamplingParams, StructuredOutputs

BAD = [
    (dict(n=0), "n must be an integer in \\[1,"),
    (dict(n=1.5), "n must be"),
    (dict(temperature=-0.1), "temperature must be a finite number in \\[0, 10000\\]"),
    (dict(temperature=1e39), "temperature must be a finite number in \\[0, 10000\\]"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p must be a finite number in \\(0, 1\\]"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k must be an integer in \\[-1, 2147483647\\]"),
    (dict(top_k=1180591620717411303424), "top_k must be an integer in \\[-1, 2147483647\\]"),
    (dict(min_p=1.5), "min_p must be a finite number in \\[0, 1\\]"),
    (dict(presence_penalty=2.5), "presence_penalty must be a finite number in \\[-2, 2\\]"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number in \\[0.0001, 10000\\]"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"),
    (dict(repetition_penalty=1e30), "repetition_penalty"),
    (dict(seed=2**64), "seed must be an integer in"),
    (dict(seed="7"), "seed"),
    (dict(max_tokens=0), "max_tokens must be an integer in \\[1, 2147483647\\]"),
    (dict(max_tokens=2**63), "max_tokens must be an integer in \\[1, 2147483647\\]"),
    (dict(max_tokens=None, min_tokens=2**40), "min_tokens must be an integer in \\[0, 2147483647\\]"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens must be an integer in \\[0, 3\\]"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(stop=[""]), "stop must be"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[2**64]), "stop_token_ids must be a list of token ids \\(integers in \\[0, 2147483647\\]\\)"),
    (dict(logprobs=-1), "logprobs must be an integer in \\[0,"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(logprobs=2**70), "logprobs must be an integer in \\[0, 2147483647\\]"),
    (dict(prompt_logprobs=2**70), "prompt_logprobs must be an integer in \\[0, 2147483647\\]"),
    (dict(logprobs_mode="cooked"), "logprobs_mode must be one of"),
    (dict(golden_token_ids=[1, "x"]), "golden_token_ids"),
    (dict(golden_token_ids=[1, 2, 3], max_tokens=2), "golden_token_ids has 3 ids, more than max_tokens=2"),
    (dict(golden_token_ids=list(range(17))), "golden_token_ids has 17 ids, more than max_tokens=16"),  # the default
    (dict(logit_bias={5: 101}), "logit_bias\\[5\\] must be a finite number in \\[-100, 100\\]"),
    (dict(logit_bias={-5: 1}), "logit_bias keys"),
    (dict(logit_bias={"99999999999999999999999": 1}), "logit_bias keys must be token ids \\(integers in \\[0, 2147483647\\]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(ignore_eos="yes"), "ignore_eos must be a bool"),
    (dict(structured_outputs=42), "structured_outputs must be a StructuredOutputs or a dict"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))[:20] for k, _ in BAD])
def test_bad_values_raise_naming_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", logprobs_mode="processed_logprobs", seed=-1, logit_bias={"7": 2})
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.logprobs_mode == "processed"
    assert p.seed64 == 2**64 - 1 and p.logit_bias == {7: 2.0}
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(top_k=0).top_k == 0  # 0 and -1 both disable top-k (vLLM)


def test_golden_token_ids_may_be_as_many_as_max_tokens():
    """Forced ids past max_tokens could never be emitted (the output ends there): a longer list is an
    error above; up to max_tokens of them, or any number without a max_tokens, is a request."""
    assert SamplingParams(golden_token_ids=[1, 2], max_tokens=2).golden_token_ids == [1, 2]
    assert SamplingParams(golden_token_ids=[1] * 100, max_tokens=None).golden_token_ids == [1] * 100


def test_verify_vocab_names_the_field():
    SamplingParams(stop_token_ids=[3], golden_token_ids=[1, 2]).verify_vocab(10)
    with pytest.raises(ValueError, match="golden_token_ids contains token id 10, outside the vocabulary \\[0, 10\\)"):
        SamplingParams(golden_token_ids=[1, 10]).verify_vocab(10)
    with pytest.raises(ValueError, match="logit_bias contains token id 99"):
        SamplingParams(logit_bias={99: 1.0}).verify_vocab(10)
    # a grammar that starts after ids no output can hold never starts: the request ran unconstrained
    so = {"regex": "a+", "start_after_token_ids": [3, 12]}
    SamplingParams(structured_outputs=so).verify_vocab(13)
    with pytest.raises(ValueError, match="structured_outputs.start_after_token_ids contains token id 12"):
        SamplingParams(structured_outputs=so).verify_vocab(10)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_structured_outputs_valid_forms():
    assert StructuredOutputs(json=SCHEMA).kind == "json"
    assert StructuredOutputs(json='{"type": "string"}').json == {"type": "string"}
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(regex="[a-z]+").kind == "regex"
    assert StructuredOutputs(grammar='root ::= "a" | "b"').kind == "grammar"
    assert StructuredOutputs(choice=("x", "y")).choice == ["x", "y"]
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(p.structured_outputs, StructuredOutputs)
    assert StructuredOutputs(regex="a+").key() != StructuredOutputs(regex="a+", any_whitespace=True).key()


BAD_SO = [
    (dict(), "exactly one of json, json_object, regex, grammar, choice; got none"),
    (dict(regex="a", choice=["a"]), "exactly one of .* got \\['regex', 'choice'\\]"),
    (dict(regex="(a"), "structured_outputs.regex does not compile"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json={"type": "strng"}), "structured_outputs.json is not a valid JSON Schema at type"),
    (dict(json={"type": "object", "properties": {"a": {"minimum": "zero"}}}),
     "not a valid JSON Schema at properties/a/minimum"),
    (dict(json=[1, 2]), "must be a JSON Schema object"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar is not valid EBNF: .*undefined_rule"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(choice=["a", ""]), "choice must be a non-empty list of non-empty strings"),
    (dict(json_object="yes"), "json_object must be True"),
]


@pytest.mark.parametrize("kw,msg", BAD_SO)
def test_bad_structured_outputs_raise_naming_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        StructuredOutputs(**kw)

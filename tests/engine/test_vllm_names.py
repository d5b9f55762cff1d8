"""vLLM's offline names on Detent (issue 22): `from detent import LLM,
SamplingParams`, `TokensPrompt`, `LLM.shutdown()`, and vLLM-only constructor
arguments refused with what Detent uses instead."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine_helpers import text_llm

G = dict(temperature=0, ignore_eos=True, max_tokens=4)


def test_top_level_names_are_the_engine_names_and_lazy():
    import detent
    import detent.engine as engine
    for name in ("LLM", "SamplingParams", "TokensPrompt", "RequestOutput"):
        assert getattr(detent, name) is getattr(engine, name)
    with pytest.raises(AttributeError):
        detent.NotAName  # noqa: B018
    # `import detent` stays light: the engine (and torch) load on first use only
    code = "import sys, detent; assert 'torch' not in sys.modules and 'detent.engine.llm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tokens_prompt_generates_like_a_dict_and_shutdown():
    from detent import SamplingParams, TokensPrompt
    assert TokensPrompt.__required_keys__ == frozenset({"prompt_token_ids"})
    assert TokensPrompt.__optional_keys__ == frozenset({"prompt"})
    llm = text_llm()
    tp = TokensPrompt(prompt_token_ids=[5, 6, 7])
    a, b = llm.generate([tp, {"prompt_token_ids": [5, 6, 7]}], SamplingParams(**G), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == [5, 6, 7]
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([tp], SamplingParams(**G), use_tqdm=False)


@pytest.mark.parametrize("kw", [dict(attention_config={"backend": "FLASH_ATTN"}),
                                dict(kernel_config={}, compilation_config={"level": 3}),
                                dict(enable_chunked_prefill=True), dict(swap_space=4),
                                dict(trust_remote_code=True), dict(quantization="fp8")])
def test_vllm_only_arguments_refused_naming_them(kw):
    from detent import LLM
    with pytest.raises(ValueError) as e:
        LLM(model="unused", **kw)
    msg = str(e.value)
    for k in kw:
        assert k in msg
    assert "Detent" in msg


def test_unknown_argument_is_still_a_type_error():
    from detent import LLM
    with pytest.raises(TypeError, match="not_an_argument"):
        LLM(model="unused", device="cpu", not_an_argument=1)


def test_offline_bad_words_are_tokenized_and_banned():
    from detent import SamplingParams
    llm = text_llm()
    tok = llm.get_tokenizer()
    p = dict(temperature=0, ignore_eos=True, max_tokens=8)
    plain = llm.generate(["Hello"], SamplingParams(**p), use_tqdm=False)[0].outputs[0].token_ids
    word = tok.decode([plain[0]])
    banned = {ids[0] for ids in (tok.encode(word.lstrip(), add_special_tokens=False),
                                 tok.encode(" " + word.lstrip(), add_special_tokens=False)) if len(ids) == 1}
    assert plain[0] in banned
    sp = SamplingParams(bad_words=[word], **p)
    got = llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 8 and not banned & set(got)
    assert sp.bad_words_token_ids  # tokenized at admission
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words="word")

"""LLM.chat with vLLM's arguments: the template's inputs (tools, chat_template,
continue_final_message), the shapes of `messages` it takes and refuses, and OpenAI's
text content parts, as detent-serve's chat route reads them."""
from __future__ import annotations

import pytest

from detent.engine import LLM, SamplingParams

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from detent.models.tiny import write_tiny_llama
    llm = LLM(model=write_tiny_llama(str(tmp_path_factory.mktemp("tiny"))), device="cpu", dtype="float32",
              max_model_len=256, num_gpu_blocks=40)
    yield llm
    llm.shutdown()


def test_chat_takes_vllm_s_tools_template_and_continue_final_message(llm):
    """LLM.chat's vLLM arguments: `tools` and `chat_template` reach the template, and
    `continue_final_message` leaves the last message open (the prompt ends with its text)."""
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    p = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat([{"role": "user", "content": "Hi"}], p, use_tqdm=False, tools=tools, chat_template=template)
    assert out[0].prompt == "[tool get_weather]<user>Hi<assistant>"
    out = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}], p,
                   use_tqdm=False, chat_template=template, continue_final_message=True)
    assert out[0].prompt == "<user>Hi<assistant>The answer is"
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat([{"role": "user", "content": "Hi"}], p, use_tqdm=False, chat_template="{{ 'no content' }}",
                 continue_final_message=True)


def test_chat_names_malformed_messages(llm):
    """One message dict instead of a list of them was a bare KeyError: 0; a str, a list of
    strs or a generator failed inside the template or on subscripting. Each is a TypeError
    naming messages (and the entry); a list of conversations still works."""
    p = SamplingParams(temperature=0, max_tokens=2)
    m = {"role": "user", "content": "Hi"}
    for messages, where in ((m, "got dict"), ("Hi", "got str"), ((x for x in [m]), "got generator"),
                            (["Hi"], r"messages\[0\] is a str"), ([[m], m], r"messages\[1\] is a dict"),
                            ([[m, "Hi"]], r"messages\[0\]\[1\] is a str")):
        with pytest.raises(TypeError, match=r"messages must be a list of message dicts .*" + where):
            llm.chat(messages, p, use_tqdm=False, chat_template=TEMPLATE)
    outs = llm.chat([[m], [m, {"role": "assistant", "content": "x"}, m]], p, use_tqdm=False, chat_template=TEMPLATE)
    assert [o.prompt for o in outs] == ["<user>Hi", "<user>Hi<assistant>x<user>Hi"]


def test_chat_takes_openai_text_parts_as_the_server_does(llm):
    """vLLM's LLM.chat takes OpenAI's content parts; here they reached the template as a list
    (a TypeError inside it, or the list's repr in the prompt). Text parts are joined, and None
    content is "", as on detent-serve's chat route; another part is a ValueError naming it."""
    p = SamplingParams(temperature=0, max_tokens=2)
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    outs = llm.chat([[{"role": "user", "content": parts}], [{"role": "user", "content": "Hello there"}],
                     [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}]],
                    p, use_tqdm=False, chat_template=TEMPLATE)
    assert [o.prompt for o in outs] == ["<user>Hello there", "<user>Hello there", "<assistant><user>x"]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: only text parts are supported"):
        llm.chat([{"role": "user", "content": [parts[0], image]}], p, use_tqdm=False, chat_template=TEMPLATE)


def test_an_interrupted_chat_takes_its_conversations_back(llm, monkeypatch):
    """Ctrl-C in chat's step loop: its requests leave the engine before the exception does
    (they ran on unseen into the next call, and update_weights refused as busy)."""
    eng = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    m = {"role": "user", "content": "Hi"}
    real, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real()

    with monkeypatch.context() as mp:
        mp.setattr(eng, "step", step)
        with pytest.raises(KeyboardInterrupt):
            llm.chat([[m], [m, m]], p, use_tqdm=False, chat_template=TEMPLATE)
    assert not eng.has_unfinished_requests() and not eng.scheduler.requests
    norm = eng.runner.model.model.norm.weight
    assert llm.update_weights({"model.norm.weight": norm.detach().clone()}) == 1
    out = llm.chat([m], p, use_tqdm=False, chat_template=TEMPLATE)
    assert len(out[0].outputs[0].token_ids) == 4

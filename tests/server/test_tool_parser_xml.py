"""server/tool_parser_xml.py: the non-streamed results of vLLM's qwen3_coder
parser (values typed by the request's tool schemas), and streams that add up
to them however the text is cut into steps (every two-piece cut, one
character a step, random cuts with empty steps)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_tool_parsers import feed, glued, splits

from detent.server import tool_parser_xml
from detent.server.tool_parsers import extract_tool_calls

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "lat": {"type": "number"}, "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}}, "opts": {"type": "object"},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "string"}, "level": {"type": "Int32"},
    "either": {"type": ["integer", "null"]}, "temp": {"type": "float"}, "free": {}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]


def fn(name: str, *params: tuple[str, str]) -> str:
    return f"<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params) + "</function>"


def call(name: str, *params: tuple[str, str]) -> str:
    return f"<tool_call>\n{fn(name, *params)}\n</tool_call>"


W = call("get_weather", ("city", "Paris"), ("days", "3"))
W_ARGS = '{"city": "Paris", "days": 3}'
T = call("get_time", ("tz", "UTC"))
REPEATED = call("get_weather", ("city", "Paris"), ("days", "3"), ("city", "Lyon"))
NO_GT = W + "\n<tool_call>\n<function=get_time>\n<parameter=tz\nUTC\n</parameter>\n</function>\n</tool_call>"

# (text, content, calls) as vLLM 0.20's Qwen3CoderToolParser returns them with TOOLS.
CASES = [
    (W, None, [("get_weather", W_ARGS)]),
    ("Let me check.\n\n" + W, "Let me check.\n\n", [("get_weather", W_ARGS)]),
    (W + "\n" + T, None, [("get_weather", W_ARGS), ("get_time", '{"tz": "UTC"}')]),
    (f"<tool_call>\n{fn('get_weather', ('city', 'Paris'))}\n{fn('get_time', ('tz', 'UTC'))}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]),  # two functions in one block
    (call("get_weather", ("days", "3"), ("lat", "48.85"), ("metric", "True"), ("hours", "[9, 12]"),
          ("opts", "{'unit': 'C', 'n': (1, 2)}"), ("note", '{"a": 1}'), ("level", "7"), ("either", "5"), ("free", "[1]")),
     None, [("get_weather", '{"days": 3, "lat": 48.85, "metric": true, "hours": [9, 12], "opts": {"unit": "C", '
                            '"n": [1, 2]}, "note": {"a": 1}, "level": 7, "either": 5, "free": "[1]"}')]),
    # conversions that fail keep the string; "null" is null whatever the type; a boolean not "true" is false
    (call("get_weather", ("days", "three"), ("lat", "2.0"), ("metric", "yes"), ("hours", "not json"), ("city", "null"),
          ("opts", "NULL"), ("temp", "nan")),
     None, [("get_weather", '{"days": "three", "lat": 2, "metric": false, "hours": "not json", "city": null, '
                            '"opts": null, "temp": "nan"}')]),
    (call("get_weather", ("city", "Paris"), ("country", "3")), None,
     [("get_weather", '{"city": "Paris", "country": "3"}')]),  # a parameter the tool does not declare: a string
    (call("get_forecast", ("days", "3"), ("x", "[1]")), None,
     [("get_forecast", '{"days": "3", "x": "[1]"}')]),  # a tool the request does not have: strings
    (call("get_weather", ("code", "def f():\n    return '<b>'\n")), None,
     [("get_weather", '{"code": "def f():\\n    return \'<b>\'\\n"}')]),  # one newline dropped at each end
    (call("get_weather", ("city", "h\u00e9llo \u4e16\u754c \U0001f389")), None,
     [("get_weather", '{"city": "h\u00e9llo \u4e16\u754c \U0001f389"}')]),  # characters, not \\u escapes
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n", None,
     [("get_weather", '{"city": "Paris"}')]),  # unterminated
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3", None,
     [("get_weather", W_ARGS)]),  # cut short in a value
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", None,
     [("get_weather", '{"city": "Paris"}')]),  # no </function>
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</function>\n</tool_call>",
     None, [("get_weather", W_ARGS)]),  # no </parameter>: the next one ends it
    ("Sure. " + fn("get_time", ("tz", "UTC")), "Sure. ", [("get_time", '{"tz": "UTC"}')]),  # no <tool_call>
    (fn("get_time", ("tz", "UTC")) + "\n" + W, fn("get_time", ("tz", "UTC")) + "\n",
     [("get_weather", W_ARGS)]),  # with a <tool_call>, only blocks hold calls
    (W + " between " + T + " after", None, [("get_weather", W_ARGS), ("get_time", '{"tz": "UTC"}')]),  # dropped
    (REPEATED, None, [("get_weather", '{"city": "Lyon", "days": 3}')]),  # first place, last value
    ("<tool_call>\n<function=</function>\n" + fn("get_time") + "\n</tool_call>", None,
     [("get_time", "{}")]),  # a function with no `>` is dropped
    # no calls: all content
    ("Hello there.", "Hello there.", []),
    ("I will use <tool", "I will use <tool", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', []),
    ("<tool_call>\n<function=get_weather\n</tool_call>", "<tool_call>\n<function=get_weather\n</tool_call>", []),
    ("<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    ("", "", []),
    # vLLM's parse fails: a parameter with no `>`, a number too large, a Python set
    (NO_GT, NO_GT, []),
    (call("get_weather", ("lat", "1e999")), call("get_weather", ("lat", "1e999")), []),
    (call("get_weather", ("opts", "{1, 2}")), call("get_weather", ("opts", "{1, 2}")), []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_extract(text, content, calls):
    assert extract_tool_calls("qwen3_coder", text, TOOLS) == (content, calls)


def test_without_tools_values_are_strings():
    assert extract_tool_calls("qwen3_coder", W) == (None, [("get_weather", '{"city": "Paris", "days": "3"}')])
    no_props = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert extract_tool_calls("qwen3_coder", W, no_props)[1] == [("get_weather", '{"city": "Paris", "days": "3"}')]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_stream_adds_up(text, content, calls):
    for pieces in splits(text):
        got_content, got_calls, _ = feed("qwen3_coder", pieces, TOOLS)
        assert got_content == (content or ""), pieces
        if calls and text != REPEATED:  # REPEATED: test_repeated_parameter
            assert got_calls == calls, pieces
        # No calls at the end: those announced cannot be taken back (test_failed_parse_after_a_call).


def test_arguments_stream_while_generated():
    text = "Let me check.\n" + W
    _, calls, steps = feed("qwen3_coder", [*text, ""], TOOLS)
    assert calls == [("get_weather", W_ARGS)]
    args, seen, announced = "", {}, None
    for k, (_, deltas) in enumerate(steps[:-1]):
        for d in deltas:
            if "id" in d:
                announced = k
            args += d["function"]["arguments"]
        seen[text[:k + 1]] = args
    assert text[:announced + 1].endswith("<function=get_weather>")  # once the name is complete
    assert seen[text[:announced + 1]] == "{"
    assert seen[text[:text.index("Paris") + 5]] == "{"  # a value goes out once its parameter ends
    assert seen[text[:text.index("</parameter>") + 11]] == "{"
    assert seen[text[:text.index("</parameter>") + 12]] == '{"city": "Paris"'
    assert seen[text[:text.index("</function>") + 10]] == '{"city": "Paris", "days": 3'
    assert seen[text[:text.index("</function>") + 11]] == W_ARGS  # the closer at the function's end
    assert steps[-1] == ("", [])


def test_content_held_back():
    assert feed("qwen3_coder", ["I will use <tool", ""])[2] == [("I will use ", []), ("<tool", [])]
    assert feed("qwen3_coder", ["a <func", "tor> b", ""])[2] == [("a ", []), ("<functor> b", []), ("", [])]
    steps = feed("qwen3_coder", ["Hi <tool_", "call>\n<function=get_time>\n", "<parameter=tz>\nUTC\n</parameter>\n",
                                 "</function>\n</tool_call>", ""], TOOLS)[2]
    assert [s[0] for s in steps] == ["Hi ", "", "", "", ""]
    assert steps[1][1][0]["function"] == {"name": "get_time", "arguments": "{"}
    assert steps[2][1] == [{"index": 0, "function": {"arguments": '"tz": "UTC"'}}]
    assert steps[3][1] == [{"index": 0, "function": {"arguments": "}"}}] and steps[4][1] == []


def test_functions_outside_a_block_stream_at_the_end():
    text = "Sure. " + fn("get_time", ("tz", "UTC"))
    content, calls, steps = feed("qwen3_coder", [text[:20], text[20:], ""], TOOLS)
    assert (content, calls) == ("Sure. ", [("get_time", '{"tz": "UTC"}')])
    assert steps[0] == ("Sure. ", []) and steps[1] == ("", [])  # a <tool_call> after it would make it content


def test_failed_parse_after_a_call():
    content, calls, steps = feed("qwen3_coder", [NO_GT[:len(W) + 1], NO_GT[len(W) + 1:], ""], TOOLS)
    assert content == NO_GT and calls == [("get_weather", W_ARGS)]  # announced calls cannot be taken back
    assert steps[-1] == (NO_GT, [])  # all of it at the end, no further call


def test_repeated_parameter():
    # What streamed cannot be revised when a later parameter of the same name replaces a value: the pieces stop
    # there (vLLM's stream sends the key twice); a call that arrives whole streams as the non-streamed one.
    assert feed("qwen3_coder", [*REPEATED, ""], TOOLS)[1] == [("get_weather", W_ARGS[:-1])]
    assert feed("qwen3_coder", [REPEATED, ""], TOOLS)[1] == [("get_weather", '{"city": "Lyon", "days": 3}')]


def test_searches_resume_where_they_stopped(monkeypatch):
    value = "x\u00e9 <" * 10000
    text = call("get_weather", ("city", value), ("days", "3"))
    searched = []
    param_end = tool_parser_xml._param_end
    monkeypatch.setattr(tool_parser_xml, "_param_end",
                        lambda text, start: searched.append(len(text) - start) or param_end(text, start))
    _, calls, _ = feed("qwen3_coder", [*text, ""], TOOLS)
    assert calls == [("get_weather", json.dumps({"city": value, "days": 3}, ensure_ascii=False))]
    assert sum(searched) < 32 * len(text)  # a few characters a step, not the value's length


_ATOMS = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "\n", "\n", ">",
          "get_weather", "get_time", "city", "days", "opts", "tz", "3", "1.5", "null", "true", "[1, 2]", "{'k': 1}",
          "{1}", " ", "<", "<tool", "</param", "<func", "Hi ", "\u00e9", '"']


def _repeats_a_parameter(text: str) -> bool:
    for block in tool_parser_xml._blocks(text):
        for body in tool_parser_xml._spans(block, "<function=", "</function>", len(block)):
            names = [p.split(">")[0] for p in body.split("<parameter=")[1:]]
            if len(names) != len(set(names)):
                return True
    return False


def test_fragments_stream_as_parsed():
    """Texts glued from tags and values, cut at random: content always adds up, calls whenever there are."""
    called = 0
    for seed in range(1500):
        text, pieces = glued(_ATOMS, seed, 24)
        content, calls = extract_tool_calls("qwen3_coder", text, TOOLS)
        got_content, got_calls, _ = feed("qwen3_coder", pieces, TOOLS)
        assert got_content == (content or ""), pieces
        assert not calls or got_calls == calls or _repeats_a_parameter(text), pieces
        called += bool(calls)
    assert called > 100


_names = st.sampled_from(["city", "days", "metric", "hours", "opts", "note", "x"])
# no tags, and no Python literal JSON cannot write (a set, bytes) or number too large for an integer
_values = st.one_of(st.text("ac xyz\n\t.:-_=/\u00e9\u4e160123456789", max_size=12),
                    st.sampled_from(["3", "-1", "2.5", "true", "NULL", "[1, {\"a\": 2}]", "{'k': None}"]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get_weather", "get_time", "other"]),
                          st.dictionaries(_names, _values, max_size=4)), min_size=1, max_size=3),
       st.text(max_size=6), st.lists(st.integers(0, 10**4), max_size=30))
def test_generated_calls_stream_as_parsed(functions, prose, cuts):
    text = prose + "\n".join(call(name, *params.items()) for name, params in functions)
    content, calls = extract_tool_calls("qwen3_coder", text, TOOLS)
    assert content == (prose or None) and [name for name, _ in calls] == [name for name, _ in functions]
    assert [list(json.loads(args)) for _, args in calls] == [list(params) for _, params in functions]
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] + [""]
    assert feed("qwen3_coder", pieces, TOOLS)[:2] == (content or "", calls)

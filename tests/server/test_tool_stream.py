"""server/tool_stream.py against the json module: however a forced tool call's
text is cut into steps, the streamed pieces rebuild the non-streamed
`tool_calls` (server/tools.py tool_message), announced before their arguments."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from detent.server import tool_stream
from detent.server.tool_stream import ToolCallStream, stream_finish_reason
from detent.server.tools import tool_message

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                       max_leaves=12)
_calls = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "get_time", "x]}"]),
                                         "parameters": _values}), min_size=1, max_size=3)
_layouts = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}])


def _replay(stream: ToolCallStream, text: str, cuts: list[int]) -> dict[int, dict]:
    """The opening, then `text` fed in the steps `cuts` gives: the calls the deltas add up to, by index."""
    got: dict[int, dict] = {}
    for d in stream.opening():
        got[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    steps = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    for n, piece in enumerate(steps):
        for d in stream.next(piece, finished=n == len(steps) - 1):
            if "id" in d:
                assert d["index"] == len(got) and d["type"] == "function", "calls are announced in order"
                got[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
            else:
                assert d["index"] in got and set(d) == {"index", "function"}, "arguments after the announcement"
                got[d["index"]]["arguments"] += d["function"]["arguments"]
    return got


@settings(max_examples=300, deadline=None)
@given(_calls, _layouts, st.lists(st.integers(0, 10**4), max_size=40))
def test_required_stream_rebuilds_the_non_streamed_calls(calls, layout, cuts):
    text = json.dumps(calls, **layout)
    assert ToolCallStream("required").opening() == []  # no name is known before the output
    got = _replay(ToolCallStream("required"), text, cuts)
    message, finish = tool_message(text, "required", "stop")
    want = [c["function"] for c in message["tool_calls"]]
    assert [got[i] for i in range(len(got))] == want
    assert finish == stream_finish_reason("stop") == "tool_calls"


@settings(max_examples=100, deadline=None)
@given(_values, _layouts, st.lists(st.integers(0, 10**4), max_size=20))
def test_named_stream_is_the_generated_text(params, layout, cuts):
    text = json.dumps(params, **layout)
    (head,) = ToolCallStream("get_weather").opening()
    assert head["index"] == 0 and head["function"] == {"name": "get_weather", "arguments": ""}
    message, finish = tool_message(text, "get_weather", "stop")
    assert _replay(ToolCallStream("get_weather"), text, cuts) == {0: message["tool_calls"][0]["function"]}
    assert message["tool_calls"][0]["function"]["arguments"] == text
    assert finish == "stop" and stream_finish_reason("stop") == "tool_calls"  # as vLLM: its stream says tool_calls


def test_cut_short_sends_only_what_cannot_change():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2'
    got = _replay(ToolCallStream("required"), text, list(range(len(text))))
    # "2" may still grow into "21": held back, as are the closers of the open list and object
    assert got == {0: {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1'}}
    assert stream_finish_reason("length") == "length"


def test_a_long_call_is_reread_in_linear_time_in_all(monkeypatch):
    calls = [{"name": "get_time", "parameters": {"xs": list(range(40000))}}]
    text = json.dumps(calls)  # ~270k characters, streamed 8 at a time
    reads = []
    real = tool_stream.partial_loads
    monkeypatch.setattr(tool_stream, "partial_loads", lambda s, a: reads.append(len(s)) or real(s, a))
    got = _replay(ToolCallStream("required"), text, list(range(0, len(text), 8)))
    assert got == {0: {"name": "get_time", "arguments": json.dumps(calls[0]["parameters"])}}
    long_reads = [r for r in reads if r > tool_stream.EVERY_STEP_CHARS]
    # each re-read past the threshold is a sixteenth longer: about 17 x len(text) in all, where
    # re-reading every step would read about len(text)**2 / 16 (here 1700 x)
    assert sum(long_reads) < 20 * len(text), sum(long_reads) / len(text)
    assert len([r for r in reads if r <= tool_stream.EVERY_STEP_CHARS]) > 2000  # short text: every step

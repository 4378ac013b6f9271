"""Tool calls read from model text (each family's format), streamed and whole."""

from __future__ import annotations

import json

import pytest

from baton.services.router.tool_answers import ToolAnswer
from baton.services.router.tool_parsers import ParsedCall, ToolCallStream, make_parser
from baton.services.router.tools import ToolPlan

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ParsedCall("get_time", json.dumps({"tz": "UTC"}))

CASES = [
    (
        "hermes",
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
        "Let me look.",
        [WEATHER, TIME],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "UTC"}}',
        "",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]',
        "",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
        "",
        [WEATHER, TIME],
    ),
    ("hermes", "No tools needed, thanks.", "No tools needed, thanks.", []),
    ("llama3_json", "The weather is {fine}.", "The weather is {fine}.", []),
    # Broken JSON is not a call: the text stays the model's content.
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_and_streamed_answers_agree(
    parser: str, text: str, content: str, calls: list[ParsedCall]
) -> None:
    p = make_parser(parser, set())
    assert p.parse(text) == (content, calls)
    for size in (1, 3, 7):
        stream = ToolCallStream(p)
        shown = "".join(stream.add(text[i : i + size]) for i in range(0, len(text), size))
        rest, streamed_calls = stream.finish()
        assert streamed_calls == calls
        assert shown + rest == content
        if calls and parser == "hermes":
            assert shown.startswith("Let me")  # content before the call streams at once


def test_auto_picks_the_family_by_its_tokens() -> None:
    assert make_parser("auto", {"[TOOL_CALLS]", "a"}).name == "mistral"
    assert make_parser("auto", {"<|python_tag|>"}).name == "llama3_json"
    assert make_parser("auto", {"<|im_start|>"}).name == "hermes"
    with pytest.raises(ValueError, match="unknown"):
        make_parser("nope", set())


def test_named_choice_streams_arguments_as_deltas() -> None:
    answer = ToolAnswer(ToolPlan("named", [], None, function="get_weather"))
    assert answer.add("") == ("", [])
    _, (first,) = answer.add('{"city": ')
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert first["id"].startswith("call_") and first["type"] == "function"
    _, (more,) = answer.add('"Paris"}')
    assert more == {"index": 0, "function": {"arguments": '"Paris"}'}}
    assert answer.finish("stop") == ("", [], "stop")  # OpenAI: forced function -> stop


def test_required_choice_reads_the_array_and_says_tool_calls() -> None:
    answer = ToolAnswer(ToolPlan("required", [], None))
    assert answer.add('[{"name": "get_weather", "parameters": {"city": "Paris"}}]') == ("", [])
    content, (call,), reason = answer.finish("stop")
    assert content == "" and reason == "tool_calls"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = ToolAnswer(ToolPlan("required", [], None))
    cut.add('[{"name": "get_w')
    assert cut.finish("length") == ("", [], "length")  # never the raw array as content


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y"', ["a"]),
        ('[{"name": "a", "parameters": {}},\n {"name": "b", "parameters": {}}, ', ["a", "b"]),
        ('[{"name": "a", "parameters": {}}', ["a"]),
        ("[", []),
        ("", []),
    ],
)
def test_required_answer_cut_at_max_tokens_keeps_its_complete_calls(
    text: str, names: list[str]
) -> None:
    answer = ToolAnswer(ToolPlan("required", [], None))
    assert answer.add(text) == ("", [])
    content, calls, reason = answer.finish("length")
    assert content == "" and reason == "length"
    assert [c["function"]["name"] for c in calls] == names
    assert [c["index"] for c in calls] == list(range(len(names)))
    assert all(json.loads(c["function"]["arguments"]) is not None for c in calls)

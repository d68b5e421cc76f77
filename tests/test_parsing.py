"""Streaming reasoning and tool-call parsers: the same result whether the output arrives whole or
split at every possible point."""
import json

import pytest

from server.parsing import ReasoningParser, ToolCallParser, tool_format_of, typed_value

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "temp": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "when": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}]


def run_tools(fmt, text, cuts, keep_partial=False):
    p = ToolCallParser(fmt, TOOLS)
    out, last = [], 0
    for c in [*cuts, len(text)]:
        out += p.feed(text[last:c])
        last = c
    out += p.finish(keep_partial)
    merged = []
    for kind, v in out:        # adjacent text pieces are one piece, however the deltas fell
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + v)
        else:
            merged.append((kind, v))
    return [(k, v if k == "text" else (v.name, json.loads(v.arguments))) for k, v in merged]


def every_split(fmt, text, keep_partial=False):
    whole = run_tools(fmt, text, [], keep_partial)
    for i in range(len(text) + 1):
        assert run_tools(fmt, text, [i], keep_partial) == whole, i
    assert run_tools(fmt, text, list(range(1, len(text))), keep_partial) == whole   # one char at a time
    return whole


def test_json_calls_split_everywhere():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>')
    assert every_split("json", text) == [
        ("text", "Let me check.\n"),
        ("tool_call", ("get_weather", {"city": "Paris", "days": 3})),
        ("tool_call", ("get_weather", {"city": "Köln"}))]


def test_xml_calls_typed_from_schema_split_everywhere():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n4\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
            "<parameter=temp>\n21.5\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=opts>\n{\"x\": null}\n</parameter>\n<parameter=when>\ntomorrow\n</parameter>\n"
            "</function>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    assert every_split("xml", text) == [
        ("tool_call", ("get_weather", {"city": "New York", "days": 4, "metric": False, "temp": 21.5,
                                       "tags": ["a", 1], "opts": {"x": None}, "when": "tomorrow"})),
        ("tool_call", ("get_weather", {"city": "Rome"}))]


def test_literal_tag_in_prose_is_text_and_does_not_stall():
    text = "Wrap calls in <tool_call> tags, like this one. Done."
    assert every_split("json", text) == [("text", text)]
    p = ToolCallParser("json")
    assert p.feed("Use <tool_call> ") == [("text", "Use ")]        # undecided: whitespace only so far
    assert p.feed("t") == [("text", "<tool_call> t")]             # decided at the first real character


def test_unparseable_and_cut_off_calls():
    bad = '<tool_call>{"name": "f", "arguments": {oops}}</tool_call> after'
    assert every_split("json", bad) == [("text", bad)]
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert every_split("json", cut) == [("text", cut)]
    assert every_split("json", cut, keep_partial=True) == [("tool_call", ("get_weather", {"city": "Par"}))]
    cut_xml = "<tool_call>\n<function=get_weather>\n<parameter=days>\n12"
    assert every_split("xml", cut_xml) == [("text", cut_xml)]
    assert every_split("xml", cut_xml, keep_partial=True) == [("tool_call", ("get_weather", {"days": 12}))]


def test_arguments_as_string_and_parameters_key():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "g", "parameters": {"b": 2}}</tool_call>'
    assert run_tools("json", text, []) == [("tool_call", ("f", {"a": 1})), ("tool_call", ("g", {"b": 2}))]


def run_reasoning(text, cuts, **kw):
    p = ReasoningParser(**kw)
    out, last = [], 0
    for c in [*cuts, len(text)]:
        out += p.feed(text[last:c])
        last = c
    out += p.finish()
    merged = {}
    for kind, v in out:
        merged[kind] = merged.get(kind, "") + v
    return merged


@pytest.mark.parametrize("text,kw,expect", [
    ("<think>\nplan it\n</think>\n\nThe answer.", {}, {"reasoning": "\nplan it\n", "text": "The answer."}),
    ("\n<think>a</think>b", {}, {"reasoning": "a", "text": "b"}),
    ("plan it\n</think>\n\nAnswer <think> literal", {"in_reasoning": True},
     {"reasoning": "plan it\n", "text": "Answer <think> literal"}),
    ("No thinking here.", {}, {"text": "No thinking here."}),
    ("<think>cut off mid-thought", {}, {"reasoning": "cut off mid-thought"}),
    ("<thinking is a word>", {}, {"text": "<thinking is a word>"}),
])
def test_reasoning_split_everywhere(text, kw, expect):
    for i in range(len(text) + 1):
        assert run_reasoning(text, [i], **kw) == expect, i
    assert run_reasoning(text, list(range(1, len(text))), **kw) == expect


def test_typed_values_and_format_detection():
    assert typed_value("5", {"type": "integer"}) == 5
    assert typed_value("five", {"type": "integer"}) == "five"                 # wrong type: keep the text
    assert typed_value("7", {"oneOf": [{"type": "string"}, {"type": "integer"}]}) == 7
    assert typed_value("x", {"type": ["integer", "string"]}) == "x"
    assert typed_value("{\"a\": 1}", None) == {"a": 1}
    assert tool_format_of("...<tool_call>\n<function=...") == "xml"
    assert tool_format_of("...<tool_call>\n{\"name\"...") == "json"
    assert tool_format_of("no tools") is None

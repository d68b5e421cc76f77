"""Constrained decoding through the server: JSON schemas and forced tool calls hold even for the tiny
default model (llguidance masks in the sampler)."""
import json

import anthropic
import httpx
import openai
import pytest

ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "is_capital": {"type": "boolean"}},
          "required": ["city", "is_capital"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}},
                                                        "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def valid(obj):
    return set(obj) == {"city", "is_capital"} and isinstance(obj["city"], str) and isinstance(obj["is_capital"], bool)


def test_chat_json_schema_and_json_object(client):
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    assert valid(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0.7, seed=3, max_tokens=80,
                                       response_format={"type": "json_object"})
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")


def test_forced_tool_named_and_required(client):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=80, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("celsius", "fahrenheit") and call.id.startswith("call_")
    chunks = list(client.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=80,
                                                 tools=[WEATHER, TIME], tool_choice="required", stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    json.loads(calls[0].function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.extended
def test_forced_tool_with_a_root_one_of(client):
    """Parameters that are a root oneOf (either a city or coordinates): the forced call is
    constrained to one of the branches (oneOf read as anyOf: llguidance cannot check "exactly one")."""
    where = {"type": "function", "function": {"name": "locate", "parameters": {"oneOf": [
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
         "additionalProperties": False},
        {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
         "required": ["lat", "lon"], "additionalProperties": False}]}}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Where is Paris?"}],
                                       temperature=0, max_tokens=60, tools=[where], tool_choice="required")
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    assert (set(args) == {"city"} and isinstance(args["city"], str)) or \
        (set(args) == {"lat", "lon"} and all(isinstance(v, (int, float)) for v in args.values()))


def test_responses_text_format_and_forced_function(client):
    r = client.responses.create(model="m", input=ASK[0]["content"], temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    assert valid(json.loads(r.output_text))
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    r = client.responses.create(model="m", input="Weather in Rome?", temperature=0, max_output_tokens=80,
                                tools=tools, tool_choice={"type": "function", "name": "get_weather"})
    calls = [it for it in r.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city", "unit"}


def test_anthropic_forced_tool(server_url):
    claude = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "Weather for a city",
            "input_schema": WEATHER["function"]["parameters"]}
    m = claude.messages.create(model="m", max_tokens=80, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                               tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
                               extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and set(uses[0].input) == {"city", "unit"} and uses[0].id.startswith("toolu_")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wobble"}}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_structured_requests(server_url, body, param):
    r = httpx.post(server_url + "/v1/chat/completions", json={"model": "m", "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


XML_TOOL = {"type": "function", "function": {"name": "plan_trip", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}, "mode": {"enum": ["train", "plane"]},
    "budget": {"type": "number"}, "flexible": {"type": "boolean"},
    "stops": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
    "required": ["city", "days", "mode", "stops"]}}}
UNION_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"anyOf": [
    {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}}, "required": ["query"]}]}}}


@pytest.mark.extended
@pytest.mark.parametrize("tool", [XML_TOOL, UNION_TOOL, WEATHER])
def test_forced_call_in_the_xml_format_follows_the_schema(smollm_engine, smollm, tool):
    """The Qwen3-Coder / Qwen3.5 format: the tiny model, forced by the grammar, writes a call whose
    parameters the XML parser types back into arguments that fit the schema (required ones present,
    integers, numbers, booleans, enums, arrays); a root anyOf offers the parameters of its branches."""
    from infernix_jax.engine import Request, SamplingParams
    from server.parsing import ToolCallParser
    from server.structured import tool_call_grammar, validated
    name = tool["function"]["name"]
    grammar = validated(smollm_engine, tool_call_grammar([tool], name, "xml"), "tool_choice")
    prompt = smollm.tokenizer.encode_chat([{"role": "user", "content": "Plan a trip to Rome by train."}],
                                          add_generation_prompt=True)
    r = smollm_engine.generate([Request(prompt, SamplingParams(max_tokens=200, temperature=0.8, seed=5,
                                                               grammar=grammar))])[0]
    parser = ToolCallParser("xml", [tool])
    pieces = parser.feed(r.text) + parser.finish()
    calls = [v for kind, v in pieces if kind == "tool_call"]
    assert r.finish_reason == "stop" and len(calls) == 1 and calls[0].name == name, r.text
    args = json.loads(calls[0].arguments)
    props = tool["function"]["parameters"].get("properties", {})
    if tool is XML_TOOL:
        assert {"city", "days", "mode", "stops"} <= set(args) <= set(props), args
        assert isinstance(args["city"], str) and type(args["days"]) is int and args["mode"] in ("train", "plane")
        assert isinstance(args["stops"], list) and len(args["stops"]) <= 2
        assert all(isinstance(s, str) for s in args["stops"])
        assert "budget" not in args or isinstance(args["budget"], (int, float))
        assert "flexible" not in args or isinstance(args["flexible"], bool)
    elif tool is UNION_TOOL:
        assert set(args) <= {"id", "query"} and ("id" not in args or type(args["id"]) is int), args
    else:
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), args

"""Tool calls: the Hermes / Qwen and Llama 3.1 JSON formats parsed into OpenAI tool_calls, held
back while streaming, tool instructions for a template without tools, and the grammar that
forces a call accepting exactly the calls its tools allow (llguidance over the tiny model's
tokenizer)."""
from __future__ import annotations

import json

import jsonschema
import pytest

import rjax
from rjax.runtime.grammar import Grammars
from rjax.server.tools import ToolStream, call_grammar, parse_tool_calls, render_messages, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"type": "string", "enum": ["C", "F"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_hermes_and_llama3_replies_parse_into_openai_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here", "hermes") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>", "hermes")[1] == []
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', "llama3")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    assert parse_tool_calls("The answer is 4.", "llama3") == ("The answer is 4.", [])
    assert tool_format("{{ '<|python_tag|>' }} ipython") == "llama3" and tool_format("<|im_start|>") == "hermes"


def test_a_stream_holds_back_only_what_may_be_a_call():
    s = ToolStream("hermes")
    assert [s.add(t) for t in ("<tool", "_call>\n", '{"name": "get_time", "arguments": {}}', "\n</tool_call>")] == \
        [""] * 4
    assert s.finish()[1][0]["function"]["name"] == "get_time"
    s = ToolStream("hermes")
    assert s.add("<t") == "" and s.add("ea> time") == "<tea> time" and s.add("!") == "!"
    assert s.finish() == (None, [])


def test_tools_go_into_the_system_message_of_a_template_without_them():
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    out, extra = render_messages(msgs, [WEATHER], "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert extra == {} and out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n' \
                                '</tool_call>'
    assert out[3] == {"role": "tool", "content": "<tool_response>\n12 C\n</tool_response>"}
    same, extra = render_messages(msgs, [WEATHER], "{% if tools %}{{ tools }}{% endif %}")
    assert same == msgs and extra == {"tools": [WEATHER]}


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_the_forcing_grammar_takes_a_valid_call_and_nothing_else(tiny_path, fmt):
    tok = rjax.load(tiny_path, progress=False).tokenizer
    g = Grammars(tok, tok.vocab_size, sorted(tok.eos_ids))
    key = "parameters" if fmt == "llama3" else "arguments"

    def accepts(text, name=None):
        c = g.constraint("lark", call_grammar([WEATHER, TIME], name, fmt))
        ids = tok.encode(text, add_bos=False)
        return all(c.advance(t) for t in ids) and c.accepting

    def call(name, args):
        body = json.dumps({"name": name, key: args}, separators=(",", ":"))
        return body if fmt == "llama3" else f"<tool_call>\n{body}\n</tool_call>"

    good = call("get_weather", {"city": "Oslo", "unit": "C"})
    jsonschema.validate({"city": "Oslo", "unit": "C"}, WEATHER["function"]["parameters"])
    assert accepts(good) and accepts(call("get_time", {})) and accepts(good, "get_weather")
    assert not accepts(call("get_time", {}), "get_weather")
    assert not accepts(call("get_weather", {"city": "Oslo", "unit": "K"}))
    assert not accepts(call("get_weather", {"city": "Oslo"}))
    assert not accepts(call("launch", {}))

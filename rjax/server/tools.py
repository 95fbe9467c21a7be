"""Tool (function) calling over the model's own chat template: the tools go to the template
(or, for a template that takes none, into the system message in the Hermes / Qwen words), the
reply is parsed into OpenAI `tool_calls`, and `tool_choice` "required" or a named function is
forced by a grammar (llguidance Lark with the tool's JSON schema inlined).

Formats, told apart by the template's text:
- "hermes" (Hermes, Qwen 2.5/3, and the default for a template without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once per call;
- "llama3" (Llama 3.1/3.2 JSON tool calling): the whole reply is `{"name": ..., "parameters": {...}}`,
  after `<|python_tag|>` at times.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def tool_format(template: str | None) -> str:
    if template and ("<|python_tag|>" in template or "ipython" in template) and HERMES_OPEN not in template:
        return "llama3"
    return "hermes"


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def hermes_system_prompt(tools: list[dict]) -> str:
    """Qwen 2.5's tool instructions (what its template writes), for a template that has none."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def render_messages(messages: list[dict], tools: list[dict] | None, template: str | None) -> tuple[list[dict], dict]:
    """-> (messages, extra template variables). A template that takes tools gets them as
    `tools`, and the messages as OpenAI sends them; for one that does not, the tool
    instructions join the system message, an assistant's earlier calls become its text in the
    Hermes format and tool results `<tool_response>` text."""
    if template_takes_tools(template):
        return messages, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(f'{HERMES_OPEN}\n{json.dumps(_call_body(c), ensure_ascii=False)}\n{HERMES_CLOSE}'
                             for c in calls)
            m["content"] = ((m.get("content") or "") + "\n" + text).lstrip("\n")
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _call_body(call: dict) -> dict:
    f = call.get("function", {})
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return {"name": f.get("name"), "arguments": args}


def call_grammar(tools: list[dict], name: str | None, fmt: str) -> str:
    """A Lark grammar (llguidance) of one call to the named tool, or to any of `tools`."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    key = "parameters" if fmt == "llama3" else "arguments"
    options = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        key: t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", key], "additionalProperties": False} for t in chosen]
    schema = dict(options[0] if len(options) == 1 else {"anyOf": options},
                  **{"x-guidance": {"whitespace_flexible": False}})
    call = f"%json {json.dumps(schema)}"
    if fmt == "llama3":
        return f"start: {call}\n"
    return f'start: "{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"\ncall: {call}\n'


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """A reply -> (its content without the calls, or None when nothing else is left; the calls
    as OpenAI writes them: id, type, function {name, arguments as a JSON string}). A reply that
    does not parse as calls is content alone."""
    calls = []
    if fmt == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        obj = _json(body)
        if isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj):
            calls.append(_openai_call(obj["name"], obj.get("parameters", obj.get("arguments"))))
            return None, calls
        return text, []
    if HERMES_OPEN not in text:
        return text, []
    for body in _HERMES_CALL.findall(text):
        obj = _json(body)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return text, []
        calls.append(_openai_call(obj["name"], obj.get("arguments", {})))
    content = text[: text.index(HERMES_OPEN)].strip()
    return content or None, calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _openai_call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolStream:
    """A streamed reply that may hold tool calls: `add(text)` -> content that may be sent now
    (text that cannot begin a call goes on at once; text that may is held back); `finish()` ->
    (content left, the calls)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._held = ""
        self._plain = False   # the reply is content: pass it through

    def add(self, text: str) -> str:
        if self._plain:
            return text
        self._held += text
        start = self._held.lstrip()
        if self.fmt == "llama3":
            opener = "{"
            tag = "<|python_tag|>"
            if tag.startswith(start[: len(tag)]) and len(start) <= len(tag):
                return ""
            start = start.removeprefix(tag).lstrip()
        else:
            opener = HERMES_OPEN
        n = min(len(start), len(opener))
        if start[:n] == opener[:n]:   # a call may be starting (or an empty start): hold it
            return ""
        self._plain, out, self._held = True, self._held, ""
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        if self._plain or not self._held:
            return None, []
        return parse_tool_calls(self._held, self.fmt)

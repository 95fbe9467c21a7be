"""Fuzzed HTTP request bodies for the server's /v1/completions and /v1/chat/completions: a valid
request with fields set to values of the wrong type, range or encoding, unknown fields, broken
messages, or the raw bytes damaged. Every one must get a 200 (a stream without an error event)
or a 4xx with an OpenAI error body; run by tests/server/test_app.py against a server on a
tiny model."""
from __future__ import annotations

import copy
import json
import random


def _deep(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


HTTP_VALUES = [None, True, False, 0, 1, -1, 2, 4, 17, 2 ** 31, 2 ** 63, 2 ** 100, -2 ** 100, 0.5, -0.0, 1e308,
               float("nan"), float("inf"), "", "x", "yes", "0", "a\ud800b", "a\x00b", "x" * 300, "\U0001f642" * 5,
               [], [1], [0, 1, 2], ["a"] * 5, ["a"] * 100, [""], [[1, 2]], [[]], [None], {}, {"a": 1},
               {"type": "text"}, _deep(40)]
HTTP_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
               "stream", "stream_options", "logprobs", "top_logprobs", "echo", "ignore_eos", "user", "best_of",
               "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools",
               "tool_choice", "max_completion_tokens", "metadata", "frobnicate"]
HTTP_MESSAGES = [{"role": "user"}, {"role": "wizard", "content": "hi"}, {"content": "hi"},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
                 {"role": "user", "content": [{"type": "text", "text": 5}]}, {"role": "assistant", "content": None},
                 {"role": "user", "content": "hi", "name": "n" * 300}, {"role": "tool", "content": "x"},
                 {"role": "user", "content": "a\ud800"}, {"role": "user", "content": "hi", "extra": 1}, "hi", None]


def http_body_case(rng: random.Random, model: str) -> tuple[str, bytes, str]:
    """One fuzzed request: (path, body bytes, what was done)."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": rng.choice([1, 2, 4])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "The quick brown fox"])}]
    else:
        body["prompt"] = rng.choice(["hello", "The quick", [1, 2, 3], ["a", "b"]])
    if rng.random() < 0.3:
        body.update(rng.choice([{"stream": True}, {"temperature": 0.7, "seed": 3}, {"stop": ["e", "o"]},
                                {"n": 2}, {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2},
                                {"stream": True, "stream_options": {"include_usage": True}}]))
    steps = []
    for _ in range(rng.choices([1, 2, 3], [60, 30, 10])[0]):
        kind = rng.choices(["field", "drop", "message", "raw"], [70, 8, 12 if chat else 0, 10])[0]
        if kind == "field":
            key = rng.choice(HTTP_FIELDS)
            body[key] = copy.deepcopy(rng.choice(HTTP_VALUES))
            steps.append(f"{key} = {body[key]!r:.40}")
        elif kind == "drop" and body:
            key = rng.choice(sorted(body))
            del body[key]
            steps.append(f"drop {key}")
        elif kind == "message":
            messages = body.get("messages") if isinstance(body.get("messages"), list) else []
            messages.insert(rng.randint(0, len(messages)), copy.deepcopy(rng.choice(HTTP_MESSAGES)))
            body["messages"] = messages
            steps.append(f"message {messages!r:.60}")
    raw = json.dumps(body).encode()  # json escapes: a lone surrogate goes as "\ud800", NaN as NaN
    if rng.random() < 0.1:
        cut = rng.choice(["truncate", "bad utf-8", "not an object", "empty", "nested 100,000 deep"])
        deep = b"[" * 100_000 + b"]" * 100_000  # written out: json.dumps would recurse out of stack
        raw = {"truncate": raw[:rng.randrange(max(1, len(raw)))], "bad utf-8": raw.replace(b'"', b'"\xff', 1),
               "not an object": json.dumps([body]).encode(), "empty": b"",
               "nested 100,000 deep": raw[:-1] + b', "metadata": ' + deep + b"}"}[cut]
        steps.append(cut)
    return path, raw, "; ".join(steps) or "valid"


def http_outcome(status: int, content_type: str, text: str) -> str:
    """A response's outcome class: '200', '<status> <param or code>', or 'FAIL ...'."""
    if status == 200:
        if "text/event-stream" in content_type:
            events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return "FAIL stream without [DONE]"
            if any('"error"' in e[:12] for e in events[:-1]):
                return f"FAIL error event in a 200 stream: {events[-2][:120]}"
            return "200 stream"
        return "200"
    try:
        error = json.loads(text)["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["message"]
    except Exception:  # noqa: BLE001
        return f"FAIL {status} without an OpenAI error body: {text[:120]}"
    if not 400 <= status < 500:
        return f"FAIL {status}: {error['message'][:120]}"
    return f"{status} {error['param'] or error['code']}"

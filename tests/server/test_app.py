"""`rjax serve`: the OpenAI-compatible server, driven by the openai client (httpx for raw bodies
and error cases) against a real uvicorn on 127.0.0.1 in a background thread, serving a tiny
synthetic model on the CPU.

References are independent routes: `rjax.generate` for greedy text, and prefill over a fresh
cache (the functional API) with log_softmax on the host for log-probabilities.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import random
import re
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import uvicorn

import rjax
from rjax.math.cache import init_cache
from rjax.runtime.serving import ServingConfig, ServingEngine
from rjax.server.app import create_app
from rjax.server.loop import EngineLoop, Setup
from rjax.server.metrics import Metrics
from rjax.server.middleware import ServerSettings
from tests.fuzz import http_body

MODEL = "tiny"
# Positions per sequence 64: a prompt of 64 tokens is too long, 10 + 60 new tokens too many.
CONFIG = ServingConfig(n_slots=4, max_len=64, page_size=8, steps_per_dispatch=4, prefill_buckets=(4,))
TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'RAISE' %}{{ raise_exception('no RAISE here') }}{% endif %}"
            "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
API_KEY = "sekret"


class GatedEngine(ServingEngine):
    """Steps only while `gate` is set (a step with `pause_after` set clears it when done), and
    raises once from `step` after `fail_next` is set: lets a test hold the engine still (a full
    queue, a client leaving mid-generation) or break it. A request whose prompt is POISON
    raises inside `submit`."""

    POISON = [7, 7, 7, 7, 7]

    def __init__(self, *args, gate: threading.Event, fail_next: threading.Event, pause_after: threading.Event, **kw):
        super().__init__(*args, **kw)
        self.gate, self.fail_next, self.pause_after = gate, fail_next, pause_after

    def submit(self, request, *args, **kw):
        if list(request.prompt) == self.POISON:
            raise RuntimeError("injected fault in this request")
        return super().submit(request, *args, **kw)

    def step(self):
        self.gate.wait()
        if self.fail_next.is_set():
            self.fail_next.clear()
            raise RuntimeError("injected failure")
        events = super().step()
        if self.pause_after.is_set():
            self.pause_after.clear()
            self.gate.clear()
        return events


@contextlib.contextmanager
def _uvicorn(app):
    """A real uvicorn on a free 127.0.0.1 port, in a thread. -> base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def _server(model, *, tokenizer, api_key=None, max_queued=16, precompile=True, setup_gate=None, config=CONFIG):
    gate, fail_next, pause_after = threading.Event(), threading.Event(), threading.Event()
    gate.set()
    engines: list[GatedEngine] = []
    stop_ids = sorted(tokenizer.eos_ids)

    def make_engine():
        engines.append(GatedEngine(model.config, model.params, config, stop_ids=stop_ids, gate=gate,
                                   fail_next=fail_next, pause_after=pause_after))
        return engines[-1]

    def setup():
        if setup_gate is not None:
            setup_gate.wait()
        return Setup(tokenizer, make_engine, MODEL, precompile)

    metrics = Metrics()
    loop = EngineLoop(setup, max_queued=max_queued, metrics=metrics)
    app = create_app(loop, metrics, ServerSettings(api_key=api_key))
    with _uvicorn(app) as url:
        yield SimpleNamespace(url=url, app=app, loop=loop, gate=gate, fail_next=fail_next, pause_after=pause_after,
                              engines=engines, metrics=metrics,
                              tok=tokenizer, model=model, api_key=api_key)


@pytest.fixture(scope="module")
def model(tiny_path):
    m = rjax.load(tiny_path, progress=False)
    # The synthetic model's file has no chat template: the main server is given one (as
    # --chat-template does); the second server keeps none.
    return dataclasses.replace(m, tokenizer=m.tokenizer.with_chat_template(TEMPLATE, "test.jinja"))


@pytest.fixture(scope="module")
def srv(model):
    with _server(model, tokenizer=model.tokenizer) as s:
        _wait(lambda: httpx.get(f"{s.url}/health").status_code == 200, "the model to compile", timeout=600)
        yield s


@pytest.fixture(scope="module")
def strict(model):
    """A second server: API key, a queue of 2, no chat template; its setup waits for a gate
    (so /health can be seen answering 503)."""
    setup_gate = threading.Event()
    tok = dataclasses.replace(model.tokenizer, chat_template=None)
    with _server(model, tokenizer=tok, api_key=API_KEY, max_queued=2, precompile=False, setup_gate=setup_gate) as s:
        s.setup_gate = setup_gate
        yield s


def _client(s, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key or "unused", max_retries=0, timeout=120, **kw)


def _idle(s):
    """Wait until the engine holds nothing: every slot free, every page back, nothing queued."""
    eng = s.engines[-1]
    def longest():  # the device's lengths (the host frees a slot's pages just before the call that resets them)
        try:
            return int(np.asarray(eng.cache.lengths).max())
        except RuntimeError:  # donated to a call of the loop's thread meanwhile
            return -1

    # Read from this thread while the loop's thread may be mid-step: wait for all of it at once.
    _wait(lambda: (eng.n_running, eng.n_queued, s.loop.n_waiting, eng.n_free_slots, eng.pages_in_use,
                   eng.pages.unreserved, eng.runs_ahead, longest())
          == (0, 0, 0, CONFIG.n_slots, 0, eng.pages.n_pages, False, 0), "the engine to go idle")


def _cancelled(s) -> float:
    return s.metrics.requests_finished.labels("cancelled")._value.get()


def _error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def _sse_events(text: str) -> list:
    lines = [line for line in text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), text
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


# --- health, models, metrics -------------------------------------------------------------------

def test_health_is_503_until_loaded_then_200(strict):
    r = httpx.get(f"{strict.url}/health")
    assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"] == "1"
    r = httpx.get(f"{strict.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    _error(r, 503, code="model_not_ready")
    strict.setup_gate.set()
    _wait(lambda: httpx.get(f"{strict.url}/health").status_code == 200, "the second server's setup")
    health = httpx.get(f"{strict.url}/health").json()
    assert health["status"] == "ok" and isinstance(health["compiling"], list)


def test_models(srv):
    (card,) = _client(srv).models.list().data
    assert card.id == MODEL and card.owned_by == "rjax"
    assert _client(srv).models.retrieve(MODEL).id == MODEL
    _error(httpx.get(f"{srv.url}/v1/models/other"), 404, code="model_not_found")


# --- completions ---------------------------------------------------------------------------------

PROMPTS = ["hello there", "The quick brown fox", "a b c d e f"]


def test_completion_greedy_equals_generate(srv, model):
    c = _client(srv)
    for p in PROMPTS:
        ref = rjax.generate(model, p, raw=True, max_new_tokens=20)
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0)
        (choice,) = r.choices
        assert choice.text == ref.text and choice.finish_reason == ref.finish_reason == "length", p
        assert r.usage.prompt_tokens == len(ref.prompt_tokens) and r.usage.completion_tokens == 20
        assert r.usage.total_tokens == r.usage.prompt_tokens + 20 and r.object == "text_completion"
    # Token ids as the prompt, echo, and several prompts in one request.
    ids = model.tokenizer.encode(PROMPTS[0])
    ref = rjax.generate(model, PROMPTS[0], raw=True, max_new_tokens=8).text
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + ref
    r = c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [rjax.generate(model, p, raw=True, max_new_tokens=8).text
                                            for p in PROMPTS]
    _idle(srv)


def test_completion_stream_equals_the_whole(srv, model):
    c = _client(srv)
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None} and len(finishes) > 2  # streamed in pieces
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # The wire format: server-sent events ending in [DONE].
    r = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                                          stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events) == \
        rjax.generate(model, PROMPTS[1], raw=True, max_new_tokens=5).text


# --- chat ----------------------------------------------------------------------------------------

def test_chat_greedy_equals_generate_streaming_and_not(srv, model):
    c = _client(srv)
    question = "Name three primes."
    ref = rjax.generate(model, question, max_new_tokens=16)  # through the chat template
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=16,
                                  temperature=0)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length" and r.usage.prompt_tokens == len(ref.prompt_tokens)
    assert r.object == "chat.completion"
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                            max_completion_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # A conversation renders through the template as rjax's tokenizer renders it.
    messages = [{"role": "system", "content": "B"}, {"role": "user", "content": "H"},
                {"role": "assistant", "content": "Y"}, {"role": "user", "content": [{"type": "text", "text": "G"}]}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    rendered = model.tokenizer.encode_chat([dict(m, content=m["content"] if isinstance(m["content"], str) else "G")
                                            for m in messages])
    assert r.usage.prompt_tokens == len(rendered)
    # Without max_tokens a chat reply may run to the end of the context.
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= CONFIG.max_len
    _idle(srv)


def test_chat_without_a_template_is_a_clear_400(strict):
    strict.setup_gate.set()
    _wait(lambda: httpx.get(f"{strict.url}/health").status_code == 200, "the second server's setup")
    with pytest.raises(openai.BadRequestError) as e:
        _client(strict).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and "--chat-template" in e.value.message
    assert e.value.body["code"] == "chat_template_missing" and e.value.body["param"] == "messages"


# --- n, seeds, stop strings ----------------------------------------------------------------------

def test_n_choices_and_seed_reproducibility(srv):
    c = _client(srv)
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0)
    r = c.completions.create(n=3, seed=7, **kw)
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2]
    assert len(set(texts)) > 1  # the choices of one seed draw apart
    assert r.usage.completion_tokens == 36
    again = c.completions.create(n=3, seed=7, **kw)
    assert [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)] == texts
    assert c.completions.create(n=1, seed=8, **kw).choices[0].text != texts[0]
    # A seeded request draws the same tokens whatever runs beside it.
    alone = c.completions.create(n=1, seed=11, **kw).choices[0].text
    results = {}

    def noise(i):
        results[i] = c.completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=20, temperature=0.8,
                                          extra_body={"top_k": 40})

    threads = [threading.Thread(target=noise, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    beside = c.completions.create(n=1, seed=11, **kw).choices[0].text
    for t in threads:
        t.join()
    assert beside == alone and len(results) == 3
    # Greedy choices are all the same; streamed choices carry their indices.
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8,
                                  temperature=0)
    assert r.choices[0].message.content == r.choices[1].message.content
    streamed = {0: "", 1: ""}
    for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=8,
                                        temperature=0, stream=True):
        for choice in ch.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    _idle(srv)


def _token_texts(tok, ids):
    dec = tok.stream_decoder()
    return [dec.add(t) for t in ids]


def test_stop_strings_across_token_boundaries(srv, model):
    c = _client(srv)
    tok = model.tokenizer
    for prompt in PROMPTS:
        ref = rjax.generate(model, prompt, raw=True, max_new_tokens=40)
        pieces = _token_texts(tok, ref.tokens)
        # A stop string that starts inside one token and ends inside the next, at its first occurrence.
        ends = np.cumsum([len(p) for p in pieces])
        boundary = next(int(e) for i, e in enumerate(ends[:-1])
                        if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3
                        and ref.text.find(ref.text[e - 2:e + 2]) == e - 2)
        stop = ref.text[boundary - 2:boundary + 2]
        expect = ref.text[: boundary - 2]
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\u2603never"])
        assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop", (prompt, stop)
        # Tokens up to the one that completed the stop string.
        assert r.usage.completion_tokens == int(np.searchsorted(ends, boundary + 2)) + 1
        chunks = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                                   temperature=0, stop=stop, stream=True)]
        assert "".join(chunks) == expect and not any(stop in ch for ch in chunks)
        # The earliest of several stop strings wins.
        later = ref.text[boundary + 4: boundary + 8]
        if later and ref.text.find(later) > boundary:
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[later, stop])
            assert r.choices[0].text == expect
    _idle(srv)  # the stopped sequences were cancelled: their slots and pages are free


# --- log-probabilities ---------------------------------------------------------------------------

def _log_softmax_after(model, seq) -> np.ndarray:
    """log_softmax of the model's logits for the token after `seq` ([vocab]), by the functional
    API: one prefill into a fresh cache."""
    cfg, params = model.config, model.params
    tokens, lengths = rjax.pad_prompts([list(seq)])
    logits, _ = rjax.prefill(cfg, params, rjax.init_cache(cfg, 1, CONFIG.max_len), jnp.asarray(tokens),
                             jnp.asarray(lengths))
    x = np.asarray(logits[0], np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_completion_logprobs_are_log_softmax_of_the_logits(srv, model):
    c = _client(srv)
    tok = model.tokenizer
    text = lambda t: tok.decode([int(t)], skip_special=False)  # noqa: E731
    prompt = PROMPTS[2]
    for temperature in (0.0, 1.0):  # raw log-probabilities, whatever the sampling settings
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=temperature, seed=3,
                                 logprobs=5)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 9
        assert "".join(lp.tokens) == r.choices[0].text
        assert lp.text_offset == [int(x) for x in np.cumsum([0] + [len(t) for t in lp.tokens[:-1]])]
        seq = tok.encode(prompt)
        for i in range(9):
            ref = _log_softmax_after(model, seq)
            top = np.argsort(-ref, kind="stable")[:5]
            expect = {}
            for t in top:  # keyed by text: of ids that read alike, the most likely stands
                expect.setdefault(text(t), ref[t])
            assert list(lp.top_logprobs[i]) == list(expect)
            np.testing.assert_allclose(list(lp.top_logprobs[i].values()), list(expect.values()), atol=2e-4)
            # The chosen id: the one with this text and this log-probability.
            chosen = [t for t in np.flatnonzero(np.abs(ref - lp.token_logprobs[i]) < 2e-4) if text(t) == lp.tokens[i]]
            assert chosen, (temperature, i, lp.tokens[i])
            if temperature == 0:
                assert chosen[0] == top[0]
            seq.append(int(chosen[0]))
    _idle(srv)


def test_chat_logprobs_and_top_logprobs(srv, model):
    c = _client(srv)
    tok = model.tokenizer
    messages = [{"role": "user", "content": "2+2="}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(e.token for e in content) == r.choices[0].message.content
    prompt = tok.encode_chat(messages)
    ref = rjax.generate(model, "2+2=", max_new_tokens=6)
    for i, e in enumerate(content):
        ref_lp = _log_softmax_after(model, prompt + ref.tokens[:i])
        assert e.token == tok.decode([ref.tokens[i]], skip_special=False)
        assert e.logprob == pytest.approx(ref_lp[ref.tokens[i]], abs=2e-4)
        assert bytes(e.bytes).decode("utf-8") == e.token
        top = np.argsort(-ref_lp, kind="stable")[:3]
        assert [t.token for t in e.top_logprobs] == [tok.decode([int(t)], skip_special=False) for t in top]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], ref_lp[top], atol=2e-4)
    # Streaming gives the same entries, and no logprobs when not asked for.
    streamed = [e for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                       logprobs=True, top_logprobs=3, stream=True)
                if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    # The second request shares the first's prompt pages (prefix cache): the same up to float rounding.
    assert [e.token for e in streamed] == [e.token for e in content]
    np.testing.assert_allclose([e.logprob for e in streamed], [e.logprob for e in content], atol=2e-5)
    assert c.chat.completions.create(model=MODEL, messages=messages, max_tokens=3).choices[0].logprobs is None
    _idle(srv)


# --- errors --------------------------------------------------------------------------------------

def test_bad_requests_get_400_with_the_openai_error_body(srv):
    url = f"{srv.url}/v1/completions"
    good = dict(model=MODEL, prompt="hi", max_tokens=4)
    e = _error(httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}), 400,
               code="invalid_json")
    assert e["type"] == "invalid_request_error"
    _error(httpx.post(url, json=dict(good, model="gpt-4")), 400, param="model", code="model_not_found")
    _error(httpx.post(url, json=dict(good, temperature=3)), 400, param="temperature")
    _error(httpx.post(url, json=dict(good, top_p=0)), 400, param="top_p")
    _error(httpx.post(url, json=dict(good, n=0)), 400, param="n")
    _error(httpx.post(url, json=dict(good, max_tokens=0)), 400, param="max_tokens")
    _error(httpx.post(url, json=dict(good, stop=["a", "b", "c", "d", "e"])), 400, param="stop")
    _error(httpx.post(url, json=dict(good, stop="")), 400, param="stop")
    _error(httpx.post(url, json=dict(good, logprobs=21)), 400, param="logprobs")
    _error(httpx.post(url, json=dict(good, presence_penalty=2.5)), 400, param="presence_penalty")
    _error(httpx.post(url, json=dict(good, repetition_penalty=0)), 400, param="repetition_penalty")
    _error(httpx.post(url, json=dict(good, min_p=1.5)), 400, param="min_p")
    _error(httpx.post(url, json=dict(good, logit_bias={"x": 1})), 400, param="logit_bias")
    _error(httpx.post(url, json=dict(good, logit_bias={"100000": 1})), 400, param="logit_bias")
    _error(httpx.post(url, json=dict(good, top_k=2 ** 40)), 400, param="top_k")
    _error(httpx.post(url, json=dict(good, prompt=["a", "b"], n=9)), 400, param="n")  # 18 sequences > --max-queued 16
    _error(httpx.post(url, json=dict(good, echo=True, logprobs=2)), 400, param="echo")
    _error(httpx.post(url, json=dict(good, frobnicate=1)), 400, param="frobnicate", code="unknown_parameter")
    _error(httpx.post(url, json=dict(good, prompt="x" * 64)), 400, param="prompt", code="context_length_exceeded")
    _error(httpx.post(url, json=dict(good, prompt="x" * 10, max_tokens=60)), 400, param="max_tokens",
           code="context_length_exceeded")
    _error(httpx.post(url, json=dict(good, prompt=[1, 2, 100000])), 400, param="prompt")
    _error(httpx.post(url, json=dict(good, prompt=[])), 400, param="prompt")
    _error(httpx.post(url, json=[1, 2]), 400)
    chat = f"{srv.url}/v1/chat/completions"
    _error(httpx.post(chat, json=dict(model=MODEL, messages=[])), 400, param="messages")
    _error(httpx.post(chat, json=dict(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])), 400,
           param="messages")
    _error(httpx.post(chat, json=dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)),
           400)
    _error(httpx.post(chat, json=dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                      tools=[{"type": "function"}])), 400, param="tools")
    _error(httpx.get(f"{srv.url}/v1/nowhere"), 404)
    with pytest.raises(openai.BadRequestError) as e:
        _client(srv).completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    _idle(srv)  # nothing was queued


def test_text_that_is_not_valid_unicode_gets_400_naming_the_field(srv):
    """A lone surrogate ("\\ud800" in JSON) or a NUL in any text field is the client's error."""
    url, chat = f"{srv.url}/v1/completions", f"{srv.url}/v1/chat/completions"
    good = dict(model=MODEL, prompt="hi", max_tokens=2)

    def post(url, body):  # as JSON escapes: "\\ud800" is valid JSON, but not a valid str to encode
        return httpx.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"})

    for bad in ("a\ud800b", "a\x00b"):
        why = "unpaired surrogate U+D800 at index 1" if "\ud800" in bad else "NUL character at index 1"
        for field, value in [("prompt", bad), ("prompt", ["ok", bad]), ("stop", bad), ("stop", [bad]),
                             ("model", bad), ("user", bad)]:
            e = _error(post(url, dict(good, **{field: value})), 400, param=field, code="invalid_value")
            assert why in e["message"], e
        for message in ({"role": "user", "content": bad}, {"role": "user", "content": [{"type": "text", "text": bad}]},
                        {"role": "user", "content": "hi", "name": bad}):
            e = _error(post(chat, dict(model=MODEL, messages=[message])), 400, param="messages")
            assert e["message"].startswith("messages.0.") and why in e["message"], e
    e = _error(httpx.post(url, json=dict(good, stop=["x" * 257])), 400, param="stop")
    assert "at most 256 characters" in e["message"]
    _idle(srv)


def test_types_are_strict_and_limits_named(srv):
    url = f"{srv.url}/v1/completions"
    good = dict(model=MODEL, prompt="hi", max_tokens=2)
    for field, value in [("n", True), ("max_tokens", 2.0), ("stream", "yes"), ("echo", 1), ("temperature", "0"),
                         ("seed", 2 ** 100), ("seed", -2 ** 63 - 1), ("logprobs", False)]:
        _error(httpx.post(url, json=dict(good, **{field: value})), 400, param=field, code="invalid_value")
    e = _error(httpx.post(url, json=dict(good, stop=["s"] * 100)), 400, param="stop")
    assert e["message"] == "stop: List should have at most 4 items after validation, not 100", e
    r = httpx.post(url, json=dict(good, seed=2 ** 63 - 1, temperature=1))  # an int for a float is fine
    assert r.status_code == 200, r.text
    _idle(srv)


def test_long_texts_are_refused_by_their_length_before_they_are_encoded(srv):
    url = f"{srv.url}/v1/completions"
    prompt = "hello " * 500_000  # 3 MB: within the body limit, far past a 64-token context
    start = time.perf_counter()
    e = _error(httpx.post(url, json=dict(model=MODEL, prompt=prompt, max_tokens=2), timeout=60), 400, param="prompt",
               code="context_length_exceeded")
    assert time.perf_counter() - start < 2.0
    assert "the prompt has 3,000,000 characters, at least" in e["message"]
    e = _error(httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                          json=dict(model=MODEL, messages=[{"role": "user", "content": prompt}])), 400,
               param="messages", code="context_length_exceeded")
    # A body declared past the 4 MiB limit is refused before a byte of it is read.
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5242880\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and json.loads(body)["error"]["code"] == "request_too_large", reply
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_a_chat_template_that_fails_gets_400_naming_the_message(srv):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "RAISE"}]
    e = _error(httpx.post(f"{srv.url}/v1/chat/completions", json=dict(model=MODEL, messages=messages)), 400,
               param="messages", code="chat_template_error")
    assert e["message"] == ("test.jinja: the chat template failed at message 1 (role 'assistant'): "
                            "no RAISE here"), e


HTTP_CASES = 300


def test_fuzzed_request_bodies_get_200_or_a_4xx(srv):
    """Seeded fuzzed bodies (tests/fuzz/http_body.py: wrong types, ranges and encodings, unknown fields,
    broken messages, damaged JSON): each gets a 200 or a 4xx with an OpenAI error body, never a
    500, an error inside a 200 stream, or a hang; and the engine is left idle."""
    counts, failures = collections.Counter(), []
    with httpx.Client(timeout=30) as client:
        for i in range(HTTP_CASES):
            path, body, what = http_body.http_body_case(random.Random(f"http:{i}"), MODEL)
            try:
                r = client.post(srv.url + path, content=body, headers={"Content-Type": "application/json"})
                outcome = http_body.http_outcome(r.status_code, r.headers.get("content-type", ""), r.text)
            except httpx.TimeoutException:
                outcome = "FAIL hang"
            counts[outcome.split(":")[0]] += 1
            if outcome.startswith("FAIL"):
                failures.append(f"case {i} ({path}: {what}): {outcome}")
    assert not failures, "\n".join(failures[:20])
    # both ends are reached: requests that run and many kinds of refusal
    assert counts["200"] + counts["200 stream"] > HTTP_CASES // 10 and len(counts) > 15, counts
    _idle(srv)


def test_api_key(strict):
    strict.setup_gate.set()
    _wait(lambda: httpx.get(f"{strict.url}/health").status_code == 200, "the second server's setup")
    url = f"{strict.url}/v1/models"
    _error(httpx.get(url), 401, code="invalid_api_key")
    _error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    _error(httpx.post(f"{strict.url}/v1/completions", json=dict(model=MODEL, prompt="hi"),
                      headers={"Authorization": "Basic " + API_KEY}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{strict.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert _client(strict).completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    # Health stays open to probes; metrics and the API's documentation need the key.
    assert httpx.get(f"{strict.url}/health").status_code == 200
    for path in ("/metrics", "/docs", "/openapi.json"):
        _error(httpx.get(f"{strict.url}{path}"), 401, code="invalid_api_key")
    assert httpx.get(f"{strict.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_a_full_queue_gets_429_with_retry_after(strict):
    strict.setup_gate.set()
    _wait(lambda: httpx.get(f"{strict.url}/health").status_code == 200, "the second server's setup")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    strict.gate.clear()  # the engine holds still: accepted sequences wait
    try:
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", httpx.post(
            f"{strict.url}/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=4, n=2), headers=headers,
            timeout=120)))
        t.start()
        _wait(lambda: strict.loop.n_waiting == 2, "two sequences in the queue")
        r = httpx.post(f"{strict.url}/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=4),
                       headers=headers)
        e = _error(r, 429, code="queue_full")
        assert r.headers["retry-after"] == "1" and "--max-queued" in e["message"]
        with pytest.raises(openai.RateLimitError):
            _client(strict).completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        strict.gate.set()
    t.join(120)
    assert first["r"].status_code == 200 and len(first["r"].json()["choices"]) == 2
    _idle(strict)


# --- clients that leave, failures ----------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_slot_and_pages(srv):
    before, asked = _cancelled(srv), srv.loop.n_cancel_requests
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{srv.url}/v1/completions",
                           json=dict(model=MODEL, prompt="hello", max_tokens=50, temperature=0, stream=True)) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            srv.gate.clear()  # hold the engine so the sequence cannot finish by itself meanwhile
            eng = srv.engines[-1]
            assert eng.n_running == 1 and eng.pages_in_use > 0
    # The connection is closed; the server notices and cancels (applied once the engine may
    # step again), and the engine frees the slot.
    _wait(lambda: srv.loop.n_cancel_requests == asked + 1, "the server to cancel the sequence")
    srv.gate.set()
    _idle(srv)
    assert _cancelled(srv) == before + 1
    # A non-streaming request whose client gives up is cancelled too.
    srv.gate.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/chat/completions", timeout=0.5,
                   json=dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0))
    _wait(lambda: srv.loop.n_cancel_requests == asked + 2, "the server to cancel the sequence")
    srv.gate.set()
    _idle(srv)
    assert _cancelled(srv) == before + 2


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(srv, model):
    c = _client(srv)
    srv.fail_next.set()
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert "injected failure" in e.value.message and e.value.body["type"] == "server_error"
    # The stream's status line has gone out: the error arrives as its last event.
    srv.fail_next.set()
    r = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=4, stream=True))
    assert "injected failure" in _sse_events(r.text)[-1]["error"]["message"]
    ref = rjax.generate(model, PROMPTS[0], raw=True, max_new_tokens=6).text
    assert c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text == ref
    _idle(srv)


def test_a_request_that_fails_inside_the_engine_fails_alone(srv, model):
    """A fault injected into one request's submission: that request gets a 500 with an OpenAI
    error body, a request running beside it finishes, and the server goes on serving."""
    c = _client(srv)
    ref = rjax.generate(model, PROMPTS[1], raw=True, max_new_tokens=12).text
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{srv.url}/v1/completions", json=dict(
                model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)) as beside:
            lines = beside.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            r = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt=GatedEngine.POISON, max_tokens=4))
            e = _error(r, 500)
            assert e["type"] == "server_error" and "injected fault in this request" in e["message"]
            rest = [line for line in lines if line.startswith("data: ")]
    events = _sse_events("\n".join(rest))
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text == ref
    _idle(srv)


class _FaultyConstraint:
    """A real constraint whose `method` raises at its `at`-th call."""

    def __init__(self, real, method: str, at: int):
        self.real, self.method, self.at, self.calls = real, method, at, 0

    def _call(self, method: str):
        if method == self.method:
            self.calls += 1
            if self.calls == self.at:
                raise ValueError(f"injected fault in {method} call {self.at}")

    def mask(self):
        self._call("mask")
        return self.real.mask()

    def advance(self, token):
        self._call("advance")
        self.real.advance(token)


# guided_regex -> (the constraint method that raises, at which call): the first mask and advance
# come with the prefill, the second with a decode dispatch.
FAULTY_REGEXES = {"[a-z]{5}": ("mask", 1), "[a-z]{6}": ("mask", 2), "[a-z]{7}": ("advance", 1),
                  "[a-z]{8}": ("advance", 2)}


BESIDE_TOKENS = 24


def _beside(srv, faulty: list[tuple[str, dict]], held=lambda: None):
    """Run `faulty` requests ((path, body), in threads) while a greedy stream of PROMPTS[1] of
    BESIDE_TOKENS is decoding: the engine is held after the stream's first step until all of
    them wait in its inbox, so they meet the stream in its next steps; `held()` is called while
    it is held. -> (the faulty responses, the stream's events)."""
    out = [None] * len(faulty)
    srv.pause_after.set()
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{srv.url}/v1/completions", json=dict(
                model=MODEL, prompt=PROMPTS[1], max_tokens=BESIDE_TOKENS, temperature=0, stream=True)) as beside:
            lines = beside.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert not srv.gate.is_set()
            held()
            waiting = srv.loop.n_waiting
            threads = [threading.Thread(target=lambda i=i, path=path, body=body: out.__setitem__(i, httpx.post(
                f"{srv.url}{path}", json=body, timeout=60))) for i, (path, body) in enumerate(faulty)]
            try:
                for t in threads:
                    t.start()
                _wait(lambda: srv.loop.n_waiting == waiting + len(faulty), "the requests to reach the inbox")
            finally:
                srv.gate.set()
            for t in threads:
                t.join(60)
            rest = [line for line in lines if line.startswith("data: ")]
    return out, _sse_events("\n".join([first] + rest))


def test_faults_inside_one_request_fail_it_alone(srv, model, monkeypatch):
    """Faults injected into single requests, in the engine (their constraint's mask or advance,
    in the prefill and in a decode dispatch; their sampling set-up) and in the handler
    (detokenizing, streamed and not): each such request gets a 500 (or a stream's error event)
    naming what failed; a greedy stream decoding beside them gets the reference text, and the
    engine ends idle, every slot and page back."""
    import rjax.runtime.grammar
    import rjax.runtime.runner
    from rjax.server.text import ChoiceText

    real_constraint = rjax.runtime.grammar.Grammars.constraint
    real_host, real_add = rjax.runtime.runner.LogitAdjust.host, ChoiceText.add

    def constraint(self, kind, spec):
        c = real_constraint(self, kind, spec)
        return _FaultyConstraint(c, *FAULTY_REGEXES[spec]) if spec in FAULTY_REGEXES else c

    def host(rows):
        if any(13.0 in (r.get("logit_bias") or {}).values() for r in rows):
            raise ValueError("injected fault in the sampling set-up")
        return real_host(rows)

    def add(self, tokens, logprobs=None):
        if "@@" in self._stops:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault in detokenizing")
        return real_add(self, tokens, logprobs)

    monkeypatch.setattr(rjax.runtime.grammar.Grammars, "constraint", constraint)
    monkeypatch.setattr(rjax.runtime.runner.LogitAdjust, "host", staticmethod(host))
    monkeypatch.setattr(ChoiceText, "add", add)
    errors_before = srv.metrics.requests_finished.labels("error")._value.get()
    ref = rjax.generate(model, PROMPTS[1], raw=True, max_new_tokens=BESIDE_TOKENS).text
    body = dict(model=MODEL, prompt="x", max_tokens=6, temperature=0)
    faulty = [("/v1/completions", dict(body, guided_regex=regex)) for regex in FAULTY_REGEXES]
    faulty += [("/v1/completions", dict(body, logit_bias={"5": 13})),
               ("/v1/completions", dict(body, stop=["@@"])), ("/v1/completions", dict(body, stop=["@@"], stream=True))]
    out, events = _beside(srv, faulty)
    for regex, r in zip(FAULTY_REGEXES, out):
        method, at = FAULTY_REGEXES[regex]
        e = _error(r, 500)
        assert e["type"] == "server_error" and e["message"] == (
            f"this request's constraint failed: ValueError: injected fault in {method} call {at}"), e
    e = _error(out[4], 500)
    assert e["message"] == "this request's sampling set-up failed: ValueError: injected fault in the sampling set-up"
    e = _error(out[5], 500)
    assert e["message"].startswith("detokenizing this request's tokens failed: UnicodeDecodeError"), e
    assert out[6].status_code == 200
    last = _sse_events(out[6].text)[-1]
    assert last["error"]["message"].startswith("detokenizing this request's tokens failed: UnicodeDecodeError")
    assert "".join(ev["choices"][0]["text"] for ev in events) == ref
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    _idle(srv)
    # Faults in the engine end their requests there (finish reason "error"); detokenizing
    # faults cancel theirs.
    assert srv.metrics.requests_finished.labels("error")._value.get() == errors_before + 5
    monkeypatch.undo()
    c = _client(srv)
    assert c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=BESIDE_TOKENS,
                                temperature=0).choices[0].text == ref
    _idle(srv)


def _oom(monkeypatch, program, after: bool):
    """Make the next call of device program `program` (a function of rjax.engine.slots) fail as XLA does
    when out of memory: before it runs (the cache intact), or `after` it ran (its donated
    cache consumed, its results lost)."""
    import rjax.runtime.runner

    real, armed = rjax.runtime.runner.run_program, [True]

    def run_program(fn, *args):
        if fn is not program or not armed[0]:
            return real(fn, *args)
        armed[0] = False
        if after:
            real(fn, *args)
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")

    monkeypatch.setattr(rjax.runtime.runner, "run_program", run_program)


@pytest.mark.parametrize("after", [False, True], ids=["cache-intact", "cache-lost"])
def test_a_device_error_fails_its_step_and_the_server_goes_on(srv, model, monkeypatch, caplog, after):
    """An out-of-memory error injected into the prefill dispatch of one request, while a stream
    decodes beside it: the request gets a 500 naming the program and the error, the log names
    the program and the failed request ids once; with the cache intact the stream goes on to the
    reference text, and with the cache consumed by the failed call it fails too (its error
    event names the program). Either way the same engine goes on over every slot and page, serves
    the reference text, and /health and /metrics count the failed step."""
    from rjax.engine.slots import prefill_into_slots

    c = _client(srv)
    ref = rjax.generate(model, PROMPTS[1], raw=True, max_new_tokens=BESIDE_TOKENS).text
    n_engines, failed_before = len(srv.engines), srv.loop.failed_steps
    with caplog.at_level("ERROR", logger="rjax.runtime.serving"):
        out, events = _beside(srv, [("/v1/completions", dict(model=MODEL, prompt="hi", max_tokens=4))],
                              held=lambda: _oom(monkeypatch, prefill_into_slots, after))
    e = _error(out[0], 500)
    assert e["type"] == "server_error" and re.fullmatch(
        r"the device failed running prefill P=\d+ T=\d+: JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
        r"trying to allocate 1.00GiB. \(this request was in it\)", e["message"]), e
    logged = [r.getMessage() for r in caplog.records if "the device failed running" in r.getMessage()]
    assert len(logged) == 1, logged
    ids = re.search(r"failed request\(s\): (.*)$", logged[0]).group(1).split(", ")
    if after:
        assert "were lost with it and are allocated afresh" in logged[0] and len(ids) == 2, logged
        assert events[-1]["error"]["message"].startswith("the device failed running prefill P="), events[-1]
        assert events[-1]["error"]["message"].endswith(", and with it the KV cache of this request"), events[-1]
    else:
        assert "the cache is intact" in logged[0] and len(ids) == 1, logged
        assert "".join(ev["choices"][0]["text"] for ev in events) == ref
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    monkeypatch.undo()
    assert c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=BESIDE_TOKENS,
                                temperature=0).choices[0].text == ref
    _idle(srv)
    assert len(srv.engines) == n_engines  # the engine went on: not rebuilt
    health = httpx.get(f"{srv.url}/health").json()
    assert health["status"] == "ok" and health["failed_steps"] == failed_before + 1
    assert health["last_failure"].startswith("the device failed running prefill P=")
    scraped = httpx.get(f"{srv.url}/metrics").text
    assert re.search(rf"^rjax_failed_steps_total {failed_before + 1}\.0$", scraped, re.M), scraped


def test_draining_refuses_new_requests_while_running_ones_finish(srv, model):
    ref = rjax.generate(model, PROMPTS[0], raw=True, max_new_tokens=10).text
    out = {}
    srv.gate.clear()
    try:
        t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
            f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0),
            timeout=60)))
        t.start()
        _wait(lambda: srv.engines[-1].has_work, "the request to reach the engine")
        srv.app.state.draining.set()
        r = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=2))
        _error(r, 503, code="shutting_down")
        assert r.headers["retry-after"] == "1"
        _error(httpx.get(f"{srv.url}/health"), 503, code="shutting_down")  # load balancers stop sending
    finally:
        srv.gate.set()
    t.join(60)
    srv.app.state.draining.clear()
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == ref
    _idle(srv)


def test_metrics(srv):
    _client(srv).completions.create(model=MODEL, prompt="hi", max_tokens=5, temperature=0)
    text = httpx.get(f"{srv.url}/metrics").text

    def value(name):
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        assert m, name
        return float(m.group(1))

    assert value("rjax_requests_running") == 0 and value("rjax_requests_queued") == 0
    assert value("rjax_kv_pages_in_use") == 0 and value("rjax_kv_pages_total") == CONFIG.pool_pages
    assert value("rjax_prompt_tokens_total") >= 2 and value("rjax_generation_tokens_total") >= 5
    assert value("rjax_time_to_first_token_seconds_count") >= 1
    assert value("rjax_inter_token_latency_seconds_count") >= 4
    assert value('rjax_requests_finished_total{finish_reason="length"}') >= 1
    assert value('rjax_http_requests_total{route="/v1/completions",status="200"}') >= 1
    assert "rjax_free_slots" in text


def test_metrics_count_prefix_cache_hits(srv):
    """The same long prompt twice: the second shares the first's full pages."""
    prompt = "the quick brown fox jumps over the dog"
    n = len(srv.tok.encode(prompt))
    assert n > 2 * CONFIG.page_size
    read = lambda name: float(re.search(rf"^{name} ([0-9.e+-]+)$", httpx.get(f"{srv.url}/metrics").text,  # noqa: E731
                                        re.M).group(1))
    hits, saved = read("rjax_prefix_cache_hits_total"), read("rjax_prefix_cache_tokens_saved_total")
    for _ in range(2):
        _client(srv).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert read("rjax_prefix_cache_hits_total") >= hits + 1
    assert read("rjax_prefix_cache_tokens_saved_total") >= saved + (n - 1) // CONFIG.page_size * CONFIG.page_size
    assert "rjax_kv_pages_cached" in httpx.get(f"{srv.url}/metrics").text


def test_ignore_eos_generates_the_whole_budget(srv):
    """ignore_eos (vLLM's and llama-server's): no end-of-sequence stop, max_tokens tokens."""
    eos = sorted(srv.tok.eos_ids)[0]
    r = _client(srv).completions.create(model=MODEL, prompt=[eos, eos, eos], max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


@pytest.mark.slow
def test_default_model_16_concurrent_streams_and_logprobs(smollm2):
    """The real default model: 16 streaming chat requests at once, each equal to its solo greedy
    rjax.generate; a completion's token log-probabilities equal rjax.runtime.scoring's within 1e-4.
    (16 slots, not 32: the same concurrent batching, half the solo references, and a cache of
    128 positions, all these prompts and replies need. No precompile: on the CPU, compiling
    every bucket's program for the 30-layer model costs more than the test; the programs the
    requests take compile on first use.)"""
    import asyncio

    from rjax.runtime.scoring import score_ids

    tok = smollm2.tokenizer
    config = ServingConfig(n_slots=16, max_len=128, page_size=16, steps_per_dispatch=8, prefill_buckets=(1, 8, 16),
                           max_prefill_tokens=1024)
    questions = [f"In one sentence, what is {i} times {i + 3}?" for i in range(16)]
    with _server(smollm2, tokenizer=tok, config=config, max_queued=64, precompile=False) as s:
        _wait(lambda: httpx.get(f"{s.url}/health").status_code == 200, "the model to compile", timeout=900)
        client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=900)

        async def one(q):
            stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                          max_tokens=12, temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def every():
            return await asyncio.wait_for(asyncio.gather(*(one(q) for q in questions)), 900)

        got = asyncio.run(every())
        prompt = "The capital of France is"
        r = _client(s).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
        lp = r.choices[0].logprobs.token_logprobs
    for q, text in zip(questions, got):
        assert text == rjax.generate(smollm2, q, max_new_tokens=12).text, q
    ids = rjax.generate(smollm2, prompt, raw=True, max_new_tokens=8).tokens
    [want] = score_ids(smollm2.config, smollm2.params, [tok.encode(prompt)], [ids])
    np.testing.assert_allclose(lp, want, atol=1e-4)


# --- the common surface: embeddings, tokenize, logit adjustments --------------------------------

def test_embeddings_are_mean_pooled_normalized_hidden_states(srv, model):
    """/v1/embeddings through the openai client (which asks for base64 and decodes it) and as
    floats: each input's final-normed hidden states (a fresh forward pass of it alone) averaged
    over its tokens and L2-normalized; strings and token arrays alike; dimensions refused."""
    from rjax.math.model import hidden_states

    cfg, params, tok = model.config, model.params, srv.tok
    texts = ["hello there", "a much longer input, of several more tokens than the first one"]

    def want(ids):
        T = len(ids)
        h, _ = hidden_states(cfg, params, init_cache(cfg, 1, T), jnp.asarray([ids], jnp.int32),
                             jnp.arange(T, dtype=jnp.int32)[None], None)
        v = np.asarray(h[0], np.float64).mean(axis=0)
        return v / np.linalg.norm(v)

    r = _client(srv).embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    for d, t in zip(r.data, texts):
        np.testing.assert_allclose(d.embedding, want(tok.encode(t)), atol=2e-5)
    ids = [[5, 6, 7], [9, 10, 11, 12, 13]]
    raw = httpx.post(f"{srv.url}/v1/embeddings", json=dict(model=MODEL, input=ids, encoding_format="float"),
                     timeout=120).json()
    for d, i in zip(raw["data"], ids):
        assert len(d["embedding"]) == cfg.d_model
        np.testing.assert_allclose(d["embedding"], want(i), atol=2e-5)
    _error(httpx.post(f"{srv.url}/v1/embeddings", json=dict(model=MODEL, input="hi", dimensions=8)), 400,
           param="dimensions", code="unsupported_parameter")
    _error(httpx.post(f"{srv.url}/v1/embeddings", json=dict(model=MODEL, input=[[1, 100000]]), timeout=120), 400,
           param="input")


def test_tokenize_and_detokenize(srv):
    tok = srv.tok
    r = httpx.post(f"{srv.url}/tokenize", json=dict(model=MODEL, prompt="Hello, world")).json()
    assert r["tokens"] == tok.encode("Hello, world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONFIG.max_len
    assert httpx.post(f"{srv.url}/tokenize", json=dict(content="Hello", add_special_tokens=False)).json()[
        "tokens"] == tok.encode("Hello", add_bos=False)
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{srv.url}/tokenize", json=dict(messages=messages)).json()
    assert r["tokens"] == tok.encode_chat(messages)
    r = httpx.post(f"{srv.url}/detokenize", json=dict(tokens=tok.encode("Hello, world", add_bos=False))).json()
    assert r["prompt"] == "Hello, world"
    _error(httpx.post(f"{srv.url}/detokenize", json=dict(tokens=[10 ** 6])), 400, param="tokens")
    _error(httpx.post(f"{srv.url}/tokenize", json=dict(prompt="a", content="b")), 400)


def test_penalties_bias_and_min_p_through_the_client(srv, model):
    """A greedy completion with all three penalties and a logit_bias equals the host reference
    of their definitions (tests/math/test_sampling_adjust.py); a sampled one at min_p 1 equals greedy; a chat
    stream with include_usage ends with the usage chunk."""
    from tests.math.test_sampling_adjust import reference

    from rjax.math.model import forward

    cfg, params, tok = model.config, model.params, srv.tok
    prompt = [3, 17, 17, 40, 41, 17, 99]
    adjust = dict(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.5, logit_bias={"65": 6.0})
    seq, T = list(prompt), CONFIG.max_len
    for _ in range(12):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(seq)] = seq
        pos = np.where(np.arange(T) < len(seq), np.arange(T), -1)[None].astype(np.int32)
        logits, _ = forward(cfg, params, init_cache(cfg, 1, T), jnp.asarray(tokens), jnp.asarray(pos))
        x = reference(np.asarray(logits[0, len(seq) - 1]), prompt, seq[len(prompt):], 0.0, presence=0.7,
                      frequency=0.9, repetition=1.5, logit_bias={65: 6.0})
        seq.append(int(np.argmax(x)))
    client = _client(srv)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                  presence_penalty=0.7, frequency_penalty=0.9, logit_bias={"65": 6.0},
                                  extra_body={"repetition_penalty": 1.5, "ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [tok.decode([t], skip_special=False) for t in seq[len(prompt):]]
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert r.choices[0].text != greedy, "the adjustments changed nothing: a weak test"
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=3,
                                        extra_body={"min_p": 1.0, "ignore_eos": True}).choices[0].text
    assert sampled == greedy
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **{"presence_penalty": 1.0}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    _idle(srv)


# --- structured output and tool calls -----------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_json_schema_and_regex_through_the_client(srv):
    """On the tiny model (random weights: only the constraint makes the output well-formed): a
    strict json_schema reply validates, a guided_regex reply matches; a bad schema is a 400."""
    import jsonschema

    client = _client(srv)
    messages = [{"role": "user", "content": "hi"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "thing", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=20, temperature=0.8, seed=1,
                                  extra_body={"guided_regex": "[a-z]{2}-[0-9]{3}"})
    assert re.fullmatch("[a-z]{2}-[0-9]{3}", r.choices[0].text)
    _error(httpx.post(f"{srv.url}/v1/chat/completions", json=dict(model=MODEL, messages=messages, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), timeout=60), 400,
           param="response_format")
    _idle(srv)


# A template that takes tools (so the tiny byte-level model's prompt stays short), and tools
# whose calls fit its 1 token a byte.
TOOLS_TEMPLATE = TEMPLATE + "{% if tools %}{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{% endif %}"
SHORT_TOOLS = [{"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"z": {"type": "string", "enum": ["a", "b"]}}, "required": ["z"],
    "additionalProperties": False}}}, {"type": "function", "function": {"name": "u", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}]


def test_forced_tool_calls_through_the_client(model):
    """tool_choice required and a named function give tool_calls whose arguments validate (the
    tiny model's random weights: only the grammar makes them calls), streamed as deltas that
    add up to the same; a tool result goes back as a role tool message; a tool_choice naming
    no tool is a 400."""
    import jsonschema

    tok = dataclasses.replace(model.tokenizer, chat_template=TOOLS_TEMPLATE)
    config = ServingConfig(n_slots=2, max_len=128, page_size=8, steps_per_dispatch=4, prefill_buckets=(2,))
    with _server(model, tokenizer=tok, config=config, precompile=False) as s:
        _wait(lambda: httpx.get(f"{s.url}/health").status_code == 200, "the server", timeout=300)
        # Its programs compile on first use (no precompile): a long first answer.
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=900)
        messages = [{"role": "user", "content": "hi"}]

        def check(calls, name=None):
            assert len(calls) == 1 and (name is None or calls[0].function.name == name)
            tool = {t["function"]["name"]: t for t in SHORT_TOOLS}[calls[0].function.name]
            jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])

        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=90, temperature=0,
                                           tools=SHORT_TOOLS, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        check(r.choices[0].message.tool_calls)
        named = {"type": "function", "function": {"name": "u"}}
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=90, temperature=0,
                                           tools=SHORT_TOOLS, tool_choice=named)
        check(r.choices[0].message.tool_calls, "u")
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=90, temperature=0,
                                                tools=SHORT_TOOLS, tool_choice=named, stream=True)
        name, args, finish = "", "", None
        for c in stream:
            for d in c.choices[0].delta.tool_calls or []:
                name += d.function.name or ""
                args += d.function.arguments or ""
            finish = c.choices[0].finish_reason or finish
        assert (name, json.loads(args), finish) == ("u", json.loads(
            r.choices[0].message.tool_calls[0].function.arguments), "tool_calls")
        call = r.choices[0].message.tool_calls[0]
        history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                              {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3, temperature=0,
                                           tools=SHORT_TOOLS, tool_choice="none")
        assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens <= 3
        _error(httpx.post(f"{s.url}/v1/chat/completions", json=dict(model=MODEL, messages=messages, tools=SHORT_TOOLS,
                                                                    tool_choice={"type": "function",
                                                                                 "function": {"name": "nope"}})), 400)


@pytest.mark.slow
def test_default_model_52_json_schemas_and_a_tool_call(smollm2):
    """The real default model, through the openai client: one request per schema of
    tests/data/json_schemas.json (52 real-world-style schemas), all at once, greedy with a
    frequency penalty; every reply
    is complete JSON that validates against its schema (format checks included). Then a
    forced tool call in the model's ChatML template."""
    import asyncio
    import pathlib

    import jsonschema

    schemas = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data" / "json_schemas.json").read_text())
    config = ServingConfig(n_slots=32, max_len=320, page_size=16, steps_per_dispatch=8, prefill_buckets=(1, 8, 32),
                           max_prefill_tokens=2048)
    with _server(smollm2, tokenizer=smollm2.tokenizer, config=config, max_queued=64, precompile=False) as s:
        _wait(lambda: httpx.get(f"{s.url}/health").status_code == 200, "the model to load", timeout=900)
        client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=900)

        async def one(name, schema):
            # Greedy, a 135M model can loop inside a string ("🌱🌱🌱...") until max_tokens cuts the
            # JSON short; a frequency penalty, as a client of a small model sets one, lets it end.
            r = await client.chat.completions.create(
                model=MODEL, max_tokens=160, temperature=0, frequency_penalty=1.0,
                messages=[{"role": "user", "content": f"Give an example {name.replace('_', ' ')} as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}})
            return r.choices[0]

        async def every():
            return await asyncio.gather(*(one(n, sc) for n, sc in schemas.items()))

        replies = asyncio.run(every())
        r = _client(s).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=60,
            temperature=0, tools=[WEATHER_TOOL], tool_choice="required")
    for (name, schema), choice in zip(schemas.items(), replies):
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

"""The `rjax serve` subcommand: its arguments, the setup it builds, and (slow) the real command
serving the tiny synthetic model in a subprocess."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from rjax.cli.main import build_parser
from rjax.server.cli import make_setup

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_serve_arguments():
    a = build_parser().parse_args(["serve", "-m", "model.gguf", "--port", "9000", "--slots", "4", "--max-len", "512",
                                   "--api-key", "k", "--chat-template", "t.jinja", "--max-queued", "8"])
    assert (a.model, a.host, a.port, a.slots, a.max_len, a.api_key, a.chat_template, a.max_queued) == \
        ("model.gguf", "127.0.0.1", 9000, 4, 512, "k", "t.jinja", 8)
    d = build_parser().parse_args(["serve"])
    assert d.port == 8000 and d.api_key is None and d.max_len is None and not d.no_precompile


def test_setup_loads_the_model_with_the_given_template_and_limits(tiny_path):
    setup = make_setup(str(tiny_path), model_id="tiny", slots=2, max_len=64, steps_per_dispatch=4,
                       chat_template=(TEMPLATE, "t.jinja"), precompile=False)()
    assert setup.model_id == "tiny" and setup.tokenizer.chat_template == TEMPLATE
    assert setup.tokenizer.chat_template_source == "t.jinja"
    eng = setup.make_engine()
    assert eng.config.n_slots == 2 and eng.config.max_len == 64 and eng.config.page_size == 16
    assert eng.default_stop_ids == tuple(sorted(setup.tokenizer.eos_ids))
    with pytest.raises(ValueError, match=r"--max-len 100000 exceeds the context length"):
        make_setup(str(tiny_path), model_id="tiny", slots=2, max_len=100000, steps_per_dispatch=4,
                   chat_template=None, precompile=False)()


def test_serve_max_len_defaults_to_the_context_that_fits(tiny_path, monkeypatch, caplog):
    import dataclasses
    import logging

    import rjax.engine.memory
    from rjax.runtime.serving import check_memory

    def setup():
        return make_setup(str(tiny_path), model_id="tiny", slots=2, max_len=None, steps_per_dispatch=4,
                          chat_template=None, precompile=False)()

    eng = setup().make_engine()
    assert eng.config.max_len == eng.cfg.context_length == 8192
    # Memory for 2,048 positions a slot but not 4,096: the longest half of the context that fits, said in the log.
    plan = check_memory(eng.cfg, eng.params, dataclasses.replace(eng.config, max_len=2048), available_bytes=1 << 40)
    need = plan.kv_bytes + plan.workspace_bytes + (256 << 20)
    monkeypatch.setattr(rjax.engine.memory, "available_bytes",
                        lambda device=None, budget_bytes=None: (need, "a test budget"))
    with caplog.at_level(logging.INFO, logger="rjax.server.cli"):
        assert setup().make_engine().config.max_len == 2048
    assert "--max-len 2048" in caplog.text and "8192 positions" in caplog.text


def test_serve_refuses_bad_limits_and_templates_before_loading(tmp_path):
    from rjax.server.cli import cmd_serve

    with pytest.raises(ValueError, match="--slots must be >= 1, got 0"):
        cmd_serve(build_parser().parse_args(["serve", "--slots", "0"]))
    with pytest.raises(ValueError, match=r"--chat-template /nonexistent/t\.jinja: cannot read it"):
        cmd_serve(build_parser().parse_args(["serve", "--chat-template", "/nonexistent/t.jinja"]))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match=rf"^{broken}: the chat template does not compile: line 1: unexpected '}}'"):
        cmd_serve(build_parser().parse_args(["serve", "--chat-template", str(broken)]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_rjax_serve_end_to_end(tiny_path, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    port = _free_port()
    env = dict(os.environ, RJAX_HOME=str(tmp_path / "home"))
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "rjax.cli", "serve", "-m", str(tiny_path), "--port", str(port),
                             "--slots", "2", "--max-len", "64", "--chat-template", str(template), "--api-key", "k",
                             "--no-precompile"], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == [tiny_path.name]
        r = client.chat.completions.create(model=tiny_path.name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert "rjax_generation_tokens_total 5.0" in httpx.get(f"{url}/metrics", headers=auth).text
        # SIGTERM drains: the stream in flight runs to its end, a new request is refused (503, or
        # the connection, once the listening socket is closed), and the process exits cleanly.
        with httpx.Client(timeout=120, headers=auth) as c:
            body = dict(model=tiny_path.name, prompt="hi", max_tokens=40, ignore_eos=True, temperature=0, stream=True)
            with c.stream("POST", f"{url}/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                try:
                    late = httpx.post(f"{url}/v1/completions", headers=auth, json=dict(model=tiny_path.name, prompt="x"))
                    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
                except httpx.ConnectError:
                    pass
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn ends a drained server by its signal again

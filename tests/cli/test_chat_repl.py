"""The terminal chat and Ctrl-C: `rjax generate` and `rjax chat` as real processes sent SIGINT
mid-reply; `rjax.stream` and ChatSession stopped mid-reply in this process; the chat's slash
commands and its prefill in pieces. All on the tiny synthetic model, which has no chat template
(a base model: completed as raw text)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rjax
from rjax.cli.chat_repl import CommandError, command
from rjax.runtime.chat import ChatSession

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """$RJAX_HOME of the processes: their compile cache, shared between them."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return rjax.load(tiny_path, progress=False)


def _restore_sigint() -> None:
    # As a terminal starts it: a test run launched in the background (`make test &`) ignores
    # SIGINT, and a child Python that inherits that never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spawn(home: Path, *argv: str) -> subprocess.Popen:
    env = dict(os.environ, RJAX_HOME=str(home), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "rjax.cli", *argv], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_restore_sigint)


def _read_until(p: subprocess.Popen, done, out: bytes = b"", timeout: float = 240) -> bytes:
    """`out` and more of stdout, read until done(all of it) (or the process ends)."""
    os.set_blocking(p.stdout.fileno(), False)
    t0 = time.monotonic()
    while not done(out) and p.poll() is None:
        assert time.monotonic() - t0 < timeout, f"timed out; stdout so far: {out[-300:]!r}"
        out += p.stdout.read() or b""
        time.sleep(0.02)
    return out


def _finish(p: subprocess.Popen, out: bytes) -> tuple[bytes, str]:
    os.set_blocking(p.stdout.fileno(), True)
    rest, err = p.communicate(timeout=120)
    return out + rest, err.decode()


# Replies long enough (seconds of decoding, even on a quiet machine) that SIGINT lands while one
# is being generated.
LONG_REPLY = 8000  # within the tiny model's 8,192-position context


def test_sigint_stops_generate_keeping_the_partial_text(tiny_path, tiny_model, home):
    p = _spawn(home, "generate", "-m", str(tiny_path), "--max-new-tokens", str(LONG_REPLY), "hello")
    out = _read_until(p, lambda o: len(o) > 40)
    p.send_signal(signal.SIGINT)
    out, err = _finish(p, out)
    assert p.returncode == 130, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err and "[interrupted]" in err
    # A base model: said so, and the prompt completed as raw text.
    assert "has no chat template" in err
    text = out.decode()
    assert text.endswith("\n")
    # What was printed is the start of the reply (greedy: the same in this process).
    want = ""
    for chunk in rjax.stream(tiny_model, "hello", raw=True, max_new_tokens=LONG_REPLY):
        want += chunk
        if len(want) >= len(text):
            break
    assert len(text) - 1 > 40 and want.startswith(text[:-1])


def test_sigint_stops_a_chat_reply_and_the_conversation_goes_on(tiny_path, home, tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    p = _spawn(home, "chat", "-m", str(tiny_path), "--max-new-tokens", str(LONG_REPLY))
    p.stdin.write(b"hello\n")
    p.stdin.flush()
    out = _read_until(p, lambda o: len(o) > 60)
    p.send_signal(signal.SIGINT)
    p.stdin.write(f"/save {first}\n/set max_tokens 12\nmore\n/save {second}\n".encode())
    p.stdin.flush()
    out = _read_until(p, lambda o: second.exists() and o.endswith(b">>> "), out)
    p.send_signal(signal.SIGINT)  # at the prompt: leave (stdin stays open until it has: EOF would also leave)
    p.wait(timeout=120)
    out, err = _finish(p, out)
    assert p.returncode == 130, err[-2000:]
    assert "terminate called" not in err and "Traceback" not in err and "[interrupted" in err
    prompts = out.decode().split(">>> ")
    partial, reply = prompts[1][:-1], prompts[4][:-1]  # each reply ends with a newline
    # The interrupted reply is kept as far as it was shown, and the next turn answers after it.
    saved = json.loads(first.read_text())["messages"]
    assert saved == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": partial}]
    assert len(partial) > 60
    saved = json.loads(second.read_text())["messages"]
    assert saved[:2] == json.loads(first.read_text())["messages"]
    assert saved[2:] == [{"role": "user", "content": "more"}, {"role": "assistant", "content": reply}] and reply


def test_a_stopped_reply_leaves_session_and_cache_consistent(tiny_model):
    """A reply stopped after two chunks: the next turn over the kept cache says what a fresh
    session says to the same conversation prefilled from scratch."""
    session = ChatSession(tiny_model, max_new_tokens=600)
    reply = session.send("hello")
    shown = [next(reply), next(reply)]
    reply.close()
    assert session.messages == [{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": "".join(shown)}]
    assert int(session.cache.lengths[0]) >= len(session.cached_ids) > len(session.encode(session.messages[:1]))
    session.max_new_tokens = 12
    second = "".join(session.send("more"))
    assert session.reused_tokens > 0
    fresh = ChatSession(tiny_model, max_new_tokens=12, messages=session.messages[:2])
    assert "".join(fresh.send("more")) == second and fresh.reused_tokens == 0


def test_keyboard_interrupt_in_stream_leaves_the_model_usable(tiny_model):
    chunks = rjax.stream(tiny_model, "hello", raw=True, max_new_tokens=600)
    shown = next(chunks) + next(chunks)
    with pytest.raises(KeyboardInterrupt):
        chunks.throw(KeyboardInterrupt)
    full = rjax.generate(tiny_model, "hello", raw=True, max_new_tokens=600).text
    assert full.startswith(shown) and len(full) > len(shown)


def test_chat_commands_check_before_changing(tiny_model, tmp_path):
    session = ChatSession(tiny_model, messages=[{"role": "user", "content": "a"},
                                                {"role": "assistant", "content": "b"}])
    session, shown, leave = command(session, "/set temperature 0.7")
    assert session.temperature == 0.7 and "temperature 0.7" in shown and not leave
    for line, message in [("/set top_p 2", "top_p"), ("/set top_k x", "not an integer"),
                          ("/set max_tokens 0", ">= 1"), ("/set color red", "unknown setting"),
                          ("/frobnicate", "unknown command /frobnicate"), ("/load", "needs a file name"),
                          (f"/load {tmp_path / 'none.json'}", "none.json")]:
        with pytest.raises(CommandError, match=message):
            command(session, line)
    assert (session.temperature, session.top_p, session.top_k) == (0.7, 1.0, 0)
    session, _, _ = command(session, "/set system Be brief.")
    assert session.messages[0] == {"role": "system", "content": "Be brief."} and len(session.messages) == 3
    path = tmp_path / "c.json"
    command(session, f"/save {path}")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(CommandError, match=r"bad.json: messages\[0\]"):
        command(session, f"/load {bad}")
    loaded, _, _ = command(session.reset(), f"/load {path}")
    assert loaded.messages == session.messages and loaded.system == "Be brief." and loaded.cache is None
    assert command(loaded, "/reset")[0].messages == [{"role": "system", "content": "Be brief."}]
    assert command(loaded, "/exit")[2] and "/save FILE" in command(loaded, "/help")[1]


def test_prefill_in_chunks_gives_the_same_tokens(tiny_model):
    """A prompt of 100 tokens prefilled in pieces of 16 (one program for any length, as chat
    turns are) continues as the same prompt prefilled at once."""
    from rjax.math.cache import init_cache
    from rjax.runtime.generation import activation_dtype, stream_ids

    ids = tiny_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)[:100]
    assert len(ids) == 100

    def run(**kw):
        cache = init_cache(tiny_model.config, 1, 1024, activation_dtype())
        return [t for step in stream_ids(tiny_model, [ids], cache=cache, max_new_tokens=8, **kw) for t in step[0]]

    assert run(prefill_chunk=16) == run()
    with pytest.raises(ValueError, match="prefill_chunk"):
        stream_ids(tiny_model, [ids], prefill_chunk=10)

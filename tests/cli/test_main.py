"""The `rjax` command on the default model: generate (streamed and --json), chat, info, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, LlamaFileType

import rjax
from rjax.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def test_generate_json_matches_the_python_api(smollm2_path, smollm2, capsys):
    assert main(["generate", "-m", str(smollm2_path), "--raw", "--json", "--max-new-tokens", "12",
                 "The capital of France is"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"prompt_tokens", "tokens", "text", "ttft_s", "decode_tokens_per_s", "finish_reason"}
    ref = rjax.generate(smollm2, "The capital of France is", raw=True, max_new_tokens=12)
    assert out["prompt_tokens"] == smollm2.tokenizer.encode("The capital of France is") == ref.prompt_tokens
    assert out["tokens"] == ref.tokens and len(out["tokens"]) == 12
    assert out["text"] == smollm2.tokenizer.decode(out["tokens"])
    assert "Paris" in out["text"]
    assert out["finish_reason"] == "length" and out["ttft_s"] > 0 and out["decode_tokens_per_s"] > 0


def test_generate_streams_the_chat_reply(smollm2_path, smollm2, capsys):
    assert main(["generate", "-m", str(smollm2_path), "--max-new-tokens", "24",
                 "What is the capital of France?"]) == 0
    streamed = capsys.readouterr().out
    ref = rjax.generate(smollm2, "What is the capital of France?", max_new_tokens=24)
    assert streamed == ref.text + "\n"
    # The chat template was applied: the prompt starts with the template's system turn.
    assert ref.prompt_tokens[:2] == smollm2.tokenizer.encode("<|im_start|>system", add_bos=False)
    assert "Paris" in ref.text


def test_chat_holds_a_conversation(smollm2_path, monkeypatch, capsys):
    lines = iter(["My name is Ada.", "What is my name?"])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError

    monkeypatch.setattr("builtins.input", fake_input)
    assert main(["chat", "-m", str(smollm2_path), "--max-new-tokens", "16"]) == 0
    replies = [r for r in capsys.readouterr().out.split("\n") if r.strip()]
    assert len(replies) >= 2


def test_chat_session_feeds_the_whole_history_back(smollm2):
    from rjax.runtime.chat import ChatSession
    from rjax.runtime.generation import _visible, stream_ids

    session = ChatSession(smollm2, max_new_tokens=12)
    first = "".join(session.send("My name is Ada."))
    second = "".join(session.send("What is my name?"))
    # The second turn prefilled only what follows the cached conversation.
    assert session.reused_tokens >= len(smollm2.tokenizer.encode_chat(session.messages[:1])) - 1
    assert int(session.cache.lengths[0]) == len(session.cached_ids)
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert session.messages[1]["content"] == first and session.messages[3]["content"] == second
    # The second reply is what the model says to the whole conversation rendered by its template.
    ids = smollm2.tokenizer.encode_chat(session.messages[:3])
    assert smollm2.tokenizer.decode(smollm2.tokenizer.encode(first, add_bos=False)) in smollm2.tokenizer.decode(ids)
    # ... and says what the model says to the whole conversation prefilled from scratch.
    tokens = [t for step in stream_ids(smollm2, [ids], max_new_tokens=12, seed=session.seed + 3) for t in step[0]]
    assert smollm2.tokenizer.decode(_visible(smollm2.tokenizer, tokens)) == second
    # A reset session starts over with an empty cache.
    assert session.reset().cache is None and session.reset().messages == []


def test_info_matches_gguf_py_reader(smollm2_path, capsys):
    """The summary's numbers against gguf-py's own reader of the whole file."""
    assert main(["info", str(smollm2_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    reader = GGUFReader(smollm2_path)
    assert info["architecture"] == "llama" == reader.fields["general.architecture"].contents()
    assert info["parameters"] == sum(int(np.prod(t.shape)) for t in reader.tensors) == 134_515_008
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    by_type: dict = {}
    for t in reader.tensors:
        entry = by_type.setdefault(t.tensor_type.name, dict(count=0, bytes=0))
        entry["count"] += 1
        entry["bytes"] += int(t.n_bytes)
    assert info["tensor_types"] == by_type and by_type["Q4_1"]["count"] == 210
    assert info["quant"] == LlamaFileType(reader.fields["general.file_type"].contents()).name.removeprefix("MOSTLY_")
    assert info["config"]["context_length"] == reader.fields["llama.context_length"].contents() == 8192
    assert info["chat_template"] is ("tokenizer.chat_template" in reader.fields) is True
    assert info["config"]["n_kv_heads"] == 3 and info["config"]["head_dim"] == 64
    assert sorted((t["name"], t["type"], t["shape"], t["bytes"]) for t in info["tensors"]) == sorted(
        (t.name, t.tensor_type.name, [int(d) for d in t.shape[::-1]], int(t.n_bytes)) for t in reader.tensors)
    memory = info["memory"]
    assert memory["backend"] == "cpu" and memory["params_bytes"] == info["tensor_bytes"]
    assert memory["kv_bytes_per_position"] == 2 * 30 * 3 * 64 * 4  # K and V, layers, kv heads, head dim, float32

    assert main(["info", str(smollm2_path)]) == 0
    summary = capsys.readouterr().out
    assert "blk.0" not in summary and "memory (cpu)" in summary and "chat template  yes" in summary
    assert main(["info", str(smollm2_path), "--tensors"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blk.")]
    assert len(names) == 272 and blocks == sorted(blocks) and blocks[-1] == 29  # blk.2 before blk.10


def test_info_reads_the_header_without_jax(smollm2_path):
    """`rjax info` neither loads tensor data nor starts jax: it answers in well under a second."""
    code = ("import sys; from rjax.cli.main import main; assert main(['info', sys.argv[1]]) == 0; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch')))")
    run = subprocess.run([sys.executable, "-c", code, str(smollm2_path)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("argv, message", [
    (["generate", "-m", "/nonexistent/model.gguf", "hi"], "/nonexistent/model.gguf"),
    (["generate", "-m", "no-such-model", "hi"], "smollm2-135m-instruct"),
    (["info", "/nonexistent.gguf"], "nonexistent.gguf"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rjax: error:") and message in err and "Traceback" not in err


def test_speculative_chat_says_what_the_plain_chat_says(smollm2):
    """Two greedy turns drafted by prompt lookup, and by a draft model (the target itself, so it
    drafts what the target says) with its own cache reused across turns, give the plain session's
    replies; the second turn of each prefills only what follows the cached conversation."""
    from rjax.runtime.chat import ChatSession

    turns = ["Repeat after me exactly: the quick brown fox jumps over the lazy dog.", "Now say it once more."]
    plain = ChatSession(smollm2, max_new_tokens=16)
    want = ["".join(plain.send(t)) for t in turns]
    for speculative in ("ngram", smollm2):
        session = ChatSession(smollm2, max_new_tokens=16, speculative=speculative, draft_tokens=3)
        got = []
        for t in turns:
            got.append("".join(session.send(t)))
            counts = session.speculative_counts
            assert 0 < counts["steps"] and 0 <= counts["accepted"] <= counts["drafted"]
        assert got == want, speculative
        # A draft model's cache may lack the last position (all of the last round's drafts were
        # kept): the turn then starts one token earlier.
        assert plain.reused_tokens - (speculative is smollm2) <= session.reused_tokens <= plain.reused_tokens
        assert int(session.cache.lengths[0]) == len(session.cached_ids) == len(plain.cached_ids)
        if speculative is smollm2:
            # Its own copy drafts what it says: every draft but a float near-tie is kept.
            assert counts["accepted"] >= 0.9 * counts["drafted"] > 0
            assert session.draft_held in (len(session.cached_ids), len(session.cached_ids) - 1)


def test_chat_with_an_int8_cache_and_bad_settings(smollm2_path, smollm2, monkeypatch, capsys):
    from rjax.runtime.chat import ChatSession

    with pytest.raises(ValueError, match="kv_dtype"):
        ChatSession(smollm2, kv_dtype="int4")
    with pytest.raises(ValueError, match="draft_tokens"):
        ChatSession(smollm2, speculative="ngram", draft_tokens=0)
    lines = iter(["Say hello."])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError

    monkeypatch.setattr("builtins.input", fake_input)
    assert main(["chat", "-m", str(smollm2_path), "--max-new-tokens", "8", "--kv-dtype", "int8",
                 "--speculative", "ngram"]) == 0
    out = capsys.readouterr()
    # The reply is the one-shot generation's over the same kind of cache.
    want = rjax.generate(smollm2, "Say hello.", max_new_tokens=8, kv_dtype="int8").text
    assert out.out.strip() == want.strip() and "[speculative:" in out.err
    session = ChatSession(smollm2, max_new_tokens=8, kv_dtype="int8")
    assert "".join(session.send("Say hello.")) == want and session.cache.kv_dtype == "int8"


def test_info_plans_for_the_backend_present(tiny_path, capsys):
    import jax

    from rjax.cli.info import present_backend

    assert present_backend() == jax.default_backend() == "cpu"
    assert main(["info", str(tiny_path), "--plan"]) == 0
    present = capsys.readouterr().out
    assert main(["info", str(tiny_path), "--plan", "--backend", "cpu"]) == 0
    assert capsys.readouterr().out == present
    assert main(["info", str(tiny_path), "--plan", "--backend", "gpu"]) == 0
    assert capsys.readouterr().out != present

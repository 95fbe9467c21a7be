"""Ask the oracle (transformers on CPU torch, in `.oracle-venv`) and cache its answers on disk.

Each function runs a `run_oracle.py` subcommand with the oracle interpreter in a subprocess — torch
is never imported in the rjax env — and keeps the result under `<repo>/.cache/oracle/`, keyed by a
hash of the subcommand, the model's content (sha256), the inputs, the oracle script's source and the
oracle env's requirements. A second run of the suite reads the cache and starts no torch at all.
The subprocess (`run_oracle.py serve`) is started on the first question and kept for the test
process's next ones, so that a model is loaded into transformers once per test process.

Parallel test workers asking for the same answer wait on a per-entry file lock; results are
written to a temporary name and renamed into place, so a killed run leaves no half-written entry.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import selectors
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
ORACLE_SCRIPT = Path(__file__).resolve().with_name("run_oracle.py")
ORACLE_REQUIREMENTS = Path(__file__).resolve().with_name("requirements.txt")
ORACLE_PYTHON = REPO_ROOT / ".oracle-venv" / "bin" / "python"
CACHE_DIR = REPO_ROOT / ".cache" / "oracle"
# A whole model load plus a few forward passes on two CPU cores stays well under this.
TIMEOUT_S = 900


class OracleUnavailable(RuntimeError):
    """The oracle env is missing: `scripts/bootstrap.sh oracle` creates it."""


# --- keys -------------------------------------------------------------------------------------


def _file_sha256(path: Path) -> str:
    """sha256 of a file, remembered on disk by (path, size, mtime) so big models hash once."""
    st = path.stat()
    memo_key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = CACHE_DIR / "sha256" / hashlib.sha256(memo_key.encode()).hexdigest()
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(memo, digest)
    return digest


def _content_id(path: str | os.PathLike) -> str:
    """What a model is, independent of where it lies: a file's sha256, or a directory's file list."""
    p = Path(path)
    if p.is_file():
        return _file_sha256(p)
    if p.is_dir():
        entries = sorted(
            (str(f.relative_to(p)), _file_sha256(f)) for f in p.rglob("*") if f.is_file() and f.name != ".complete"
        )
        return hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    raise FileNotFoundError(f"oracle: model path {str(p)!r} does not exist")


def _key(command: str, model: str | os.PathLike | None, inputs) -> str:
    env_id = ORACLE_REQUIREMENTS.read_text() if ORACLE_REQUIREMENTS.is_file() else ""
    payload = {
        "command": command,
        "model": _content_id(model) if model is not None else None,
        "inputs": inputs,
        "script": hashlib.sha256(ORACLE_SCRIPT.read_bytes()).hexdigest(),
        "env": hashlib.sha256(env_id.encode()).hexdigest(),
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()
    return f"{command}-{hashlib.sha256(blob).hexdigest()[:24]}"


# --- running ----------------------------------------------------------------------------------


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


@contextmanager
def _locked(key: str):
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _oracle_python() -> Path:
    if not ORACLE_PYTHON.is_file():
        raise OracleUnavailable(
            f"the oracle env {ORACLE_PYTHON.parent.parent} is missing: run `scripts/bootstrap.sh oracle` "
            "(`make test` does it) to create it"
        )
    return ORACLE_PYTHON


class _Server:
    """The `run_oracle.py serve` process of this test process; its stderr goes to a temporary file,
    whose tail explains a failure."""

    def __init__(self):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)  # the 3.12 env's paths must not leak into the 3.11 interpreter
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(_oracle_python()), str(ORACLE_SCRIPT), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO_ROOT)

    def ask(self, args: list[str]) -> dict | None:
        """The reply to one command; None when the process ended or took longer than TIMEOUT_S."""
        try:
            self.proc.stdin.write(json.dumps(args) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(TIMEOUT_S):
                return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:].decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_server: _Server | None = None
_server_lock = threading.Lock()


@atexit.register
def _stop_server() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None


def _run(args: Sequence[str]) -> None:
    global _server
    args = [str(a) for a in args]
    _oracle_python()  # a missing env is named even while a server from before runs
    with _server_lock:
        if _server is None:
            _server = _Server()
        reply = _server.ask(args)
        if reply is None:  # dead or hung: the next question starts a fresh process
            server, _server = _server, None
            server.proc.kill()
            server.proc.wait()
            tail = server.log_tail()
            server.stop()
            raise RuntimeError(f"oracle process ended or timed out (exit {server.proc.returncode}) on "
                               f"{' '.join(args)}\n{tail}")
    if not reply["ok"]:
        raise RuntimeError(f"oracle command failed: {' '.join(args)}\n{reply['error'][-4000:]}")


def _cached_file(key: str, suffix: str, build) -> Path:
    """The cache entry `<key><suffix>`, made by `build(tmp_path)` when absent."""
    target = CACHE_DIR / f"{key}{suffix}"
    if target.is_file():
        return target
    with _locked(key):
        if not target.is_file():
            with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=".work-") as work:
                tmp = Path(work) / f"out{suffix}"
                build(Path(work), tmp)
                os.replace(tmp, target)
    return target


def _cached_dir(key: str, build) -> Path:
    """The cache directory `<key>/`, made by `build(work, tmp_dir)` when absent; `.complete` marks it done."""
    target = CACHE_DIR / key
    if (target / ".complete").is_file():
        return target
    with _locked(key):
        if not (target / ".complete").is_file():
            shutil.rmtree(target, ignore_errors=True)
            with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=".work-") as work:
                tmp = Path(work) / "out"
                build(Path(work), tmp)
                (tmp / ".complete").write_text("")
                os.replace(tmp, target)
    return target


def _write_input(work: Path, name: str, value) -> Path:
    path = work / name
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")
    return path


# --- public -----------------------------------------------------------------------------------


def oracle_tokenize(model_path: str | os.PathLike, texts: Sequence[str], messages: list[dict] | None = None) -> dict:
    """transformers' tokenizer for a `.gguf` file or checkpoint directory, applied to `texts`.

    Returns a dict with, per text (lists aligned with `texts`): `ids_with_special`
    (add_special_tokens=True), `ids_without_special`, `decoded_with_special` and
    `decoded_skip_special` (decode of the with-special ids, keeping / skipping special tokens);
    and once: `chat_template` (None when the tokenizer has none), `chat_rendered` and `chat_ids`
    (apply_chat_template(messages, add_generation_prompt=True), as text and as ids; None without
    messages or template), `bos_token_id`, `eos_token_id`, `vocab_size`, `all_special_ids`.
    """
    texts = list(texts)
    key = _key("tokenize", model_path, {"texts": texts, "messages": messages})

    def build(work: Path, out: Path) -> None:
        args = ["tokenize", "--model", Path(model_path).resolve(), "--texts", _write_input(work, "texts.json", texts)]
        if messages is not None:
            args += ["--messages", _write_input(work, "messages.json", messages)]
        _run([*args, "--out", out])

    return json.loads(_cached_file(key, ".json", build).read_text(encoding="utf-8"))


def oracle_logits(
    model_path: str | os.PathLike,
    prompt_ids_list: Sequence[Sequence[int]],
    decode_steps: int,
    all_positions: bool = False,
    greedy_tokens: int = 0,
) -> list[dict[str, np.ndarray]]:
    """transformers' float32 logits for each prompt (token ids), then greedy decoding with a KV cache.

    One dict per prompt: `last_logits` [V] after the whole prompt; `step_tokens` [N] the tokens fed
    while decoding (step_tokens[0] = argmax(last_logits), step_tokens[k] = argmax(step_logits[k-1]));
    `step_logits` [N, V] the logits produced by feeding step_tokens[k]; `greedy` [max(N, greedy_tokens)]
    the greedy continuation; with all_positions, `all_logits` [T, V] at every prompt position.
    """
    prompts = [[int(t) for t in p] for p in prompt_ids_list]
    inputs = {"prompts": prompts, "steps": int(decode_steps), "all": bool(all_positions), "greedy": int(greedy_tokens)}
    key = _key("logits", model_path, inputs)

    def build(work: Path, out: Path) -> None:
        args = ["logits", "--model", Path(model_path).resolve(), "--prompts-ids", _write_input(work, "prompts.json", prompts),
                "--decode-steps", int(decode_steps), "--greedy-tokens", int(greedy_tokens), "--out", out]
        if all_positions:
            args.append("--all-positions")
        _run(args)

    with np.load(_cached_file(key, ".npz", build)) as data:
        results = []
        for i in range(int(data["num_prompts"])):
            names = ["last_logits", "step_tokens", "step_logits", "greedy"] + (["all_logits"] if all_positions else [])
            results.append({name: data[f"{name}_{i}"] for name in names})
    return results


def oracle_save_pretrained(gguf_path: str | os.PathLike, dtype: str = "float32") -> Path:
    """A GGUF model as a plain Hugging Face checkpoint directory (safetensors weights de-quantized
    by transformers, tokenizer.json, tokenizer_config.json, chat_template.jinja when the GGUF has a
    template, config.json, generation_config.json). The directory lives in the cache: do not modify it."""
    key = _key("save-pretrained", gguf_path, {"dtype": dtype})
    return _cached_dir(
        key, lambda work, out: _run(["save-pretrained", "--model", Path(gguf_path).resolve(), "--dtype", dtype, "--out", out])
    )


def oracle_save_tokenizer(model_path: str | os.PathLike) -> Path:
    """Only the tokenizer transformers builds from a `.gguf` file (or checkpoint directory), saved
    as a Hugging Face directory: tokenizer.json, tokenizer_config.json, chat_template.jinja when the
    model has a template. The directory lives in the cache: do not modify it."""
    key = _key("save-tokenizer", model_path, {})
    return _cached_dir(
        key, lambda work, out: _run(["save-tokenizer", "--model", Path(model_path).resolve(), "--out", out])
    )


def oracle_random_qwen2(
    seed: int = 0,
    *,
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
    tokenizer: str | os.PathLike | None = None,
    **shape: int,
) -> Path:
    """A small random-weight Qwen2 checkpoint directory (default: 2 layers, hidden 64, 4 heads,
    2 KV heads, intermediate 128) with biases and norm weights randomized too. Its tokenizer is a
    tiny byte-level BPE (vocab 279, ChatML specials and template) unless `tokenizer` names a
    `.gguf`/directory whose tokenizer to save instead. `shape` overrides: hidden, intermediate,
    layers, heads, kv_heads, max_positions. The directory lives in the cache: do not modify it."""
    allowed = {"hidden", "intermediate", "layers", "heads", "kv_heads", "max_positions"}
    unknown = set(shape) - allowed
    if unknown:
        raise TypeError(f"oracle_random_qwen2: unknown shape arguments {sorted(unknown)}; allowed {sorted(allowed)}")
    inputs = {"seed": seed, "tie": tie_word_embeddings, "dtype": dtype, "shape": shape}
    key = _key("random-qwen2", tokenizer, inputs)

    def build(work: Path, out: Path) -> None:
        args = ["random-qwen2", "--seed", seed, "--dtype", dtype, "--out", out,
                "--tie-word-embeddings" if tie_word_embeddings else "--no-tie-word-embeddings"]
        if tokenizer is not None:
            args += ["--tokenizer", Path(tokenizer).resolve()]
        for name, value in sorted(shape.items()):
            args += [f"--{name.replace('_', '-')}", int(value)]
        _run(args)

    return _cached_dir(key, build)


def oracle_random_model(
    arch: str,
    seed: int = 0,
    *,
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
    **config,
) -> Path:
    """A small random-weight checkpoint directory of `arch` (llama, mistral, qwen2, gemma3_text):
    2 layers, hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, the tiny byte-level tokenizer,
    biases and norm weights randomized. `config` sets any transformers config field (JSON values),
    e.g. rope_parameters={"rope_type": "llama3", ...} or sliding_window=8. The directory lives in the
    cache: do not modify it."""
    inputs = {"arch": arch, "seed": seed, "tie": tie_word_embeddings, "dtype": dtype, "config": config}
    key = _key("random-model", None, inputs)

    def build(work: Path, out: Path) -> None:
        _run(["random-model", "--arch", arch, "--config", _write_input(work, "config.json", config),
              "--seed", seed, "--dtype", dtype, "--out", out,
              "--tie-word-embeddings" if tie_word_embeddings else "--no-tie-word-embeddings"])

    return _cached_dir(key, build)


# llama.cpp's own converter and its gguf-py, from the llama-cpp-python sdist (which vendors llama.cpp).
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
_SDIST_ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def llama_cpp_converter() -> Path:
    """llama.cpp's source directory with convert_hf_to_gguf.py, conversion/ and gguf-py/, fetched
    once from PyPI (`pip download` of the sdist, by the oracle env's pip) and kept in the cache."""
    import tarfile

    target = CACHE_DIR / LLAMA_CPP_SDIST.replace("==", "-")
    if (target / ".complete").is_file():
        return target

    def build(work: Path, out: Path) -> None:
        proc = subprocess.run([str(_oracle_python()), "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                               ":all:", LLAMA_CPP_SDIST, "-d", str(work)], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        sdists = list(work.glob("*.tar.gz"))
        if proc.returncode or len(sdists) != 1:
            raise OracleUnavailable(f"could not fetch {LLAMA_CPP_SDIST} (llama.cpp's GGUF converter) from PyPI:\n"
                                    f"{proc.stderr[-2000:]}")
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(_SDIST_ROOT) and m.name[len(_SDIST_ROOT):].startswith(_CONVERTER_PARTS)]
            tar.extractall(work / "src", members=members, filter="data")
        os.replace(work / "src" / _SDIST_ROOT, out)

    return _cached_dir(target.name, build)


def oracle_to_gguf(directory: str | os.PathLike) -> Path:
    """A checkpoint directory as llama.cpp's convert_hf_to_gguf.py writes it (float32 tensors, its
    tensor names, metadata and Q/K row order). The file lives in the cache: do not modify it."""
    key = _key("to-gguf", directory, {"converter": LLAMA_CPP_SDIST})
    converter = llama_cpp_converter()
    return _cached_file(key, ".gguf", lambda work, out: _run(
        ["to-gguf", "--model", Path(directory).resolve(), "--converter", converter, "--out", out]))

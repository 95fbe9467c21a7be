"""The fuzz run over model files: seeded mutations of tiny GGUF files (`gguf_file`) and Hugging
Face checkpoint directories (`hf_directory`: config.json, safetensors, tokenizer files, chat
templates), each loaded through `rjax.load` (config, params and tokenizer) and its chat template
rendered over a conversation.

Every case must end in a correct load (and render) or in one `ModelFileError` (or, rendering,
`ChatTemplateError`) whose message names the file.
An uncaught exception, an error that does not name the file, a crash, a hang (a load over
TIMEOUT_S), an allocation the worker's address-space limit refuses, or a load whose params and
tokenizer disagree with its config is a failure.

    python -m tests.fuzz --cases 10000             # counts per outcome; exit status 1 on a failure
    python -m tests.fuzz --case 1234 --keep DIR    # one case again, its files kept under DIR
    python -m tests.fuzz --model FILE.gguf --cases 200   # byte-level damage to a real GGUF instead

Fixtures (written once per run, about 100 KB each): two GGUF files (llama: byte-level BPE
vocabulary with merges, dense and block-quantized tensors, untied head; gemma3: sentencepiece
vocabulary with scores, byte tokens and a chat template, tied head) and two Hugging Face
directories (qwen2: one model.safetensors of bf16/f16/f32 tensors; llama: two shards and an
index). Case i of seed s takes its fixture and mutations from Random(f"{s}:{i}"), so any case
can be run again on its own.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random
import re
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np

import rjax
from rjax.loading.loaders import ModelFileError
from rjax.loading.tokenizer import ChatTemplateError, chat_template
from tests.fuzz import gguf_file, hf_directory
from tests.fuzz.common import PROBE_MESSAGES, PROBE_TEXT
from tests.fuzz.gguf_file import GGUFLayout, GGUFSpec, gemma_gguf_spec, gguf_layout, llama_gguf_spec, write_gguf
from tests.fuzz.hf_directory import write_hf_llama_sharded, write_hf_qwen2


TIMEOUT_S = 10.0
MEMORY_LIMIT = 4 << 30  # address space a case may add: a load sized from an unchecked field hits it
OK = "loaded OK"


class CaseTimeout(BaseException):
    """Raised in a case that runs past its time; a BaseException so no loader can swallow it."""


# --- fixtures on disk, and one case ---------------------------------------------------------------


@dataclasses.dataclass
class Fixture:
    name: str
    path: Path
    spec: GGUFSpec | None = None
    layout: GGUFLayout | None = None
    data: bytes = b""


GGUF_SPECS = {"llama.gguf": llama_gguf_spec, "gemma3.gguf": gemma_gguf_spec}


def make_fixtures(root: Path) -> list[Fixture]:
    root.mkdir(parents=True, exist_ok=True)
    for name, make in GGUF_SPECS.items():
        write_gguf(make(), root / name)
    write_hf_qwen2(root / "qwen2-hf")
    write_hf_llama_sharded(root / "llama-hf-sharded")
    return load_fixtures(root)


def load_fixtures(root: Path, model: Path | None = None) -> list[Fixture]:
    """The fixtures `make_fixtures(root)` wrote (GGUF specs rebuilt: they are deterministic); or,
    with `model`, that one GGUF file alone, mutated byte by byte."""
    if model is not None:
        return [Fixture(model.name, model, None, gguf_layout(model), model.read_bytes())]
    out = []
    for name, make in GGUF_SPECS.items():
        path = root / name
        out.append(Fixture(name, path, make(), gguf_layout(path), path.read_bytes()))
    return out + [Fixture("qwen2-hf", root / "qwen2-hf"), Fixture("llama-hf-sharded", root / "llama-hf-sharded")]


def make_case(rng: random.Random, fixture: Fixture, where: Path) -> tuple[Path, list[str]]:
    """A damaged copy of `fixture` under `where` -> (path to load, what was done)."""
    n = rng.choices([1, 2, 3], [70, 20, 10])[0]
    path = where / fixture.name
    if fixture.layout is not None:
        return path, gguf_file.damage(rng, n, fixture.spec, fixture.layout, fixture.data, path)
    return path, hf_directory.damage(rng, n, fixture.path, path)


def _fields(params):
    yield "embed", params.embed
    yield "final_norm", params.final_norm
    if params.lm_head is not None:
        yield "lm_head", params.lm_head
    for i, layer in enumerate(params.layers):
        for f in dataclasses.fields(layer):
            w = getattr(layer, f.name)
            if w is not None:
                yield f"layers[{i}].{f.name}", w


def check_loaded(model) -> str | None:
    """What is inconsistent in a loaded model (None: nothing): shapes against the config, NaN/Inf,
    and a tokenizer whose ids fit the embedding."""
    cfg, params = model.config, model.params
    if len(params.layers) != cfg.n_layers:
        return f"{len(params.layers)} layers for n_layers {cfg.n_layers}"
    q, kv, d, ff = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model, cfg.d_ff
    want = {"embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "wq": (q, d), "wk": (kv, d),
            "wv": (kv, d), "wo": (d, q), "w_gate": (ff, d), "w_up": (ff, d), "w_down": (d, ff), "bq": (q,),
            "bk": (kv,), "bv": (kv,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    for name, w in _fields(params):
        field = name.rsplit(".", 1)[-1]
        shape = tuple(w.shape)
        if shape != want.get(field, (d,)):
            return f"{name} has shape {shape}, config implies {want.get(field, (d,))}"
        arrays = [np.asarray(p) for p in (w.planes if hasattr(w, "planes") else (w,))]
        for a in arrays:
            if (a.dtype.kind == "f" or a.dtype.name == "bfloat16") and not np.isfinite(a.astype(np.float32)).all():
                return f"{name} holds NaN or Inf"
    if cfg.n_heads % cfg.n_kv_heads or min(cfg.n_layers, d, ff, cfg.n_heads, cfg.head_dim, cfg.vocab_size) < 1:
        return f"config out of range: {cfg}"
    tok = model.tokenizer
    ids = tok.encode(PROBE_TEXT)
    if any(not 0 <= i < cfg.vocab_size for i in ids):
        return f"tokenizer gives ids outside the embedding's {cfg.vocab_size} rows: {max(ids)}"
    if not isinstance(tok.decode(ids), str):
        return "decode did not return text"
    if tok.chat_template is not None:  # a template that fails raises ChatTemplateError naming it
        text = tok.apply_chat_template(PROBE_MESSAGES)
        if not isinstance(text, str) or len(text) > chat_template.MAX_RENDER_CHARS:
            return f"the chat template rendered {type(text).__name__} of {len(text):,} characters"
    return None


def _message_class(message: str, where: Path) -> str:
    """A message with its file, quoted names, lists and numbers blanked: one line per kind of error."""
    text = message.replace(str(where), "<file>")
    text = re.sub(r"<file>[^\s:,]*", "<file>", text)
    text = re.sub(r"b?'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\[[^\[\]]*\]|\{[^{}]*\}", "[…]", text)
    text = re.sub(r"(?<![\w.])(0x[0-9a-fA-F]+|-?\d[\d,_]*(\.\d+)?(e[+-]?\d+)?|-?inf|nan)(?![\w.])", "N", text)
    text = re.sub(r"\bblk\.\d+\.", "blk.N.", text)
    return text[:100]


def _outcome_of_error(e: BaseException, where: Path) -> str:
    message = str(e)
    if isinstance(e, (ModelFileError, ChatTemplateError)):
        kind = "ChatTemplateError" if isinstance(e, ChatTemplateError) else "ModelFileError"  # subclasses too
        if str(where) not in message:
            return f"FAIL {kind} not naming the file: {_message_class(message, where)}"
        return f"{kind}: {_message_class(message, where)}"
    return f"FAIL uncaught {type(e).__module__}.{type(e).__name__}: {_message_class(message, where)}"


def _on_alarm(signum, frame):
    raise CaseTimeout()


def run_case(seed: int, index: int, fixtures: list[Fixture], work: Path, timeout: float = TIMEOUT_S,
             keep: bool = False) -> tuple[str, list[str], float]:
    """Make and load case `index`: (outcome, what was done, seconds)."""
    rng = random.Random(f"{seed}:{index}")
    fixture = fixtures[rng.randrange(len(fixtures))]
    where = work / f"case-{index}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    path, steps = make_case(rng, fixture, where)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            model = rjax.load(path, progress=False)
            problem = check_loaded(model)
            outcome = OK if problem is None else f"FAIL inconsistent load: {_message_class(problem, where)}"
            del model
        except CaseTimeout:
            outcome = f"FAIL hang (over {timeout:g} s)"
        except Exception as e:  # noqa: BLE001 - the point: anything not a ModelFileError is a failure
            outcome = _outcome_of_error(e, where)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CaseTimeout:  # the alarm landed between the handlers above
        outcome = f"FAIL hang (over {timeout:g} s)"
    finally:
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    if not keep:
        shutil.rmtree(where, ignore_errors=True)
    return outcome, [f"{fixture.name}: {s}" for s in steps], elapsed


def limit_memory(extra: int = MEMORY_LIMIT) -> tuple[int, int]:
    """Cap this process's address space at its current size + `extra`; -> the old limits."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + extra
    if old[1] != resource.RLIM_INFINITY:
        cap = min(cap, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    return old


# --- the long run: worker processes, each case under a watchdog ------------------------------------

def _worker(conn, seed: int, fixture_root: str, work: str, timeout: float, model: str | None) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging

    logging.disable(logging.WARNING)  # the gguf writer's duplicate-key warnings
    fixtures = load_fixtures(Path(fixture_root), Path(model) if model else None)
    limit_memory()
    conn.send(("ready", None))
    while True:
        index = conn.recv()
        if index is None:
            return
        try:
            outcome, steps, elapsed = run_case(seed, index, fixtures, Path(work), timeout)
        except MemoryError:
            outcome, steps, elapsed = "FAIL uncaught MemoryError (address-space limit)", [], 0.0
        except Exception as e:  # noqa: BLE001 - a bug in making the case, not in loading it
            outcome, steps, elapsed = f"FAIL harness error {type(e).__name__}: {e}", [], 0.0
        conn.send((index, (outcome, steps, elapsed)))


def run_many(cases: range, seed: int, workers: int, timeout: float, root: Path, model: Path | None = None,
             report_every: float = 60.0):
    """Run `cases` in `workers` processes; a case over `timeout` (or a worker that dies) is killed
    and recorded, and a fresh worker takes over. -> (Counter of outcomes, failures, times)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    if model is None:
        make_fixtures(root / "fixtures")
    ctx = mp.get_context("spawn")
    counts, failures, times = collections.Counter(), [], []
    pending = list(reversed(cases))
    # slow start-up (imports) is not a case's time: the watchdog starts at the first send
    busy: dict = {}
    procs = []

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, seed, str(root / "fixtures"), str(root / "work"), timeout,
                                              str(model) if model else None), daemon=True)
        p.start()
        child.close()
        if parent.poll(120) and parent.recv()[0] == "ready":
            procs.append((p, parent))
            return p, parent
        p.kill()
        raise RuntimeError("a fuzz worker did not start")

    def feed(p, conn):
        if pending:
            index = pending.pop()
            conn.send(index)
            busy[conn] = (p, index, time.monotonic())

    for _ in range(workers):
        feed(*start())
    done, last_report, t0 = 0, time.monotonic(), time.monotonic()
    while busy:
        ready = wait(list(busy), timeout=1.0)
        for conn in ready:
            p, index, _ = busy.pop(conn)
            try:
                got_index, (outcome, steps, elapsed) = conn.recv()
            except (EOFError, OSError):
                p.join(5)
                outcome, steps, elapsed = f"FAIL crash (worker exit code {p.exitcode})", [], 0.0
                counts[outcome] += 1
                failures.append((index, outcome, steps))
                done += 1
                feed(*start())
                continue
            counts[outcome] += 1
            times.append((elapsed, index))
            if outcome.startswith("FAIL"):
                failures.append((index, outcome, steps))
            done += 1
            feed(p, conn)
        now = time.monotonic()
        for conn, (p, index, since) in list(busy.items()):
            if now - since > timeout + 5:  # the in-process alarm did not fire: a hang in native code
                p.kill()
                p.join(5)
                busy.pop(conn)
                outcome = f"FAIL hang (over {timeout:g} s, killed)"
                counts[outcome] += 1
                failures.append((index, outcome, []))
                done += 1
                feed(*start())
        if now - last_report > report_every:
            last_report = now
            rate = done / (now - t0)
            print(f"  {done}/{len(cases)} cases, {rate:.1f}/s, failures so far: {len(failures)}", flush=True)
    for p, conn in procs:
        if p.is_alive():
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(5)
    return counts, failures, times


def print_report(counts, failures, times, total: int, seconds: float, top: int = 60) -> None:
    print(f"\n{total} cases in {seconds:.0f} s")
    errors = [(k, n) for k, n in counts.most_common() if k.startswith(("ModelFileError", "ChatTemplateError"))]
    fails = sum(n for k, n in counts.items() if k.startswith("FAIL"))
    print(f"  {counts.get(OK, 0):6d}  {OK}")
    print(f"  {sum(n for _, n in errors):6d}  ModelFileError (at load) or ChatTemplateError (rendering a conversation) "
          f"naming the file, in {len(errors)} message classes:")
    for k, n in errors[:top]:
        print(f"      {n:6d}  {k}")
    if len(errors) > top:
        print(f"      {sum(n for _, n in errors[top:]):6d}  in the {len(errors) - top} other classes")
    print(f"  {fails:6d}  failures (uncaught exceptions, unnamed files, hangs, crashes, inconsistent loads)")
    for k, n in counts.most_common():
        if k.startswith("FAIL"):
            print(f"      {n:6d}  {k}")
    if times:
        ts = sorted(times)
        print(f"  case time: median {ts[len(ts) // 2][0] * 1e3:.0f} ms, max {ts[-1][0]:.2f} s (case {ts[-1][1]})")
    for index, outcome, steps in failures[:20]:
        print(f"  case {index}: {outcome}\n      " + "\n      ".join(steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--first", type=int, default=0, help="index of the first case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds after which a load counts as a hang")
    ap.add_argument("--case", type=int, default=None, help="run this one case in this process and print it")
    ap.add_argument("--keep", default=None, help="directory to keep the fixtures and cases in")
    ap.add_argument("--top", type=int, default=60, help="message classes to list (the rest are summed)")
    ap.add_argument("--model", default=None, help="fuzz this GGUF file (byte-level mutations) instead of the fixtures")
    a = ap.parse_args(argv)
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="rjax-fuzz-"))
    try:
        model = Path(a.model).resolve() if a.model else None
        if a.case is not None:
            fixtures = load_fixtures(root, model) if model else make_fixtures(root / "fixtures")
            outcome, steps, elapsed = run_case(a.seed, a.case, fixtures, root / "work", a.timeout, keep=bool(a.keep))
            print(f"case {a.case}: {outcome} ({elapsed:.2f} s)\n  " + "\n  ".join(steps))
            return 1 if outcome.startswith("FAIL") else 0
        t0 = time.monotonic()
        cases = range(a.first, a.first + a.cases)
        counts, failures, times = run_many(cases, a.seed, a.workers, a.timeout, root, model)
        print_report(counts, failures, times, len(cases), time.monotonic() - t0, a.top)
        return 1 if failures else 0
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)

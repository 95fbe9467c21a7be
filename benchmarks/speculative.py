"""Speculative decoding against plain decoding at batch 1, both measured in this run.

    python benchmarks/speculative.py --out "$OUT" --model PATH_TO_SMOLLM2_GGUF

(a) Prompt lookup (`speculative="ngram"`) on the real default model (smollm2-135m-instruct,
    --model: a catalog name or a .gguf path) with prompts that quote a given text or code and
    edit it (built in below): greedy, tokens/s of both, acceptance, and per round the verify
    cost (a forward pass of K + 1 positions, timed alone) and what the round cost beyond it.
    Whether the tokens are plain decoding's is checked ("same": yes, or the first position
    where they part). On a CPU in float32 they are identical (the tests check that). On a GPU
    in bf16 a pass of K + 1 positions rounds differently from a one-token step (other product
    tiles, a float LM head for an int8 one), so a near-tie can go the other way, and the two
    replies then differ from there on.
(b) A synthetic llama-8b Q8_0 target (written under --workdir) drafted by its own weights
    requantized to Q4_0 on load (`speculative="self:q4_0"`): acceptance, tokens/s of both, the
    draft step's and the verification's cost, the speedup the measured acceptance would give
    at those costs (expected tokens per round E = (1 - a^(K+1)) / (1 - a) over K draft steps
    and one verification, against a plain step each), and where a round's time goes.

Costs are timed as programs of many passes (a loop of 32 forward passes over a cache at the
prompt's length, on the device), so they hold no host round trips. Tokens/s are the median of
3 identical calls after a warm-up call (which compiles): decode tokens/s count the tokens after
the first over the time from the first token to the last, as GenerationResult reports them for
both; (a) also gives the speedup of whole calls (all tokens over the call's wall time, prefill
and setup included). Plain decoding runs 32 steps per program call and speculative decoding 32
rounds (--rounds-per-dispatch). Writes <out>/speculative.json after each part and prints a
table last. --skip-8b runs (a) alone, --skip-ngram (b) alone.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rjax  # noqa: E402
from rjax.engine import steps as engine  # noqa: E402
from rjax.engine.speculative import NgramDrafter  # noqa: E402
from rjax.math.cache import init_cache  # noqa: E402
from rjax.math.model import forward  # noqa: E402
from rjax.runtime.generation import activation_dtype  # noqa: E402

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def normalize(values):
    """Scale values so that they sum to one."""
    total = sum(values)
    if total == 0:
        raise ValueError("values sum to zero")
    return [value / total for value in values]
'''

TEXT = ("The library opens at nine in the morning on weekdays and at ten on Saturdays. It is closed on Sundays "
        "and on public holidays. Visitors can borrow up to six books at a time for three weeks, and a loan can be "
        "renewed twice unless another reader has reserved the book. Late returns cost twenty cents per book per "
        "day. The reading room on the second floor is reserved for quiet study, and the group rooms on the ground "
        "floor can be booked for up to two hours.")

# Prompts that quote a text or code and ask for it back, edited: most of the reply repeats it.
# The default model (135M parameters) answers text_edit with a paraphrase (about 1.9 tokens
# per round), text_digits with a copy (about 2.4-3).
PROMPTS = {
    "code_rename": f"Here is some Python code:\n\n{CODE}\nRewrite the whole code with the variable `values` renamed "
                   f"to `xs`. Output only the code.",
    "code_docstrings": f"{CODE}\nRepeat this code exactly, but add a type hint to every function argument.",
    "text_edit": f"Here is a notice:\n\n{TEXT}\n\nRewrite the notice with the opening hours changed to eight in "
                 f"the morning. Keep everything else the same.",
    "text_digits": f"{TEXT}\n\nRepeat this text exactly, but replace every number word with digits.",
}


def say(msg: str) -> None:
    print(f"[speculative {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed_generate(model, prompt, repeats: int = 3, **kw):
    """A warm-up call, then `repeats` identical calls -> (result, decode tokens/s, call tokens/s),
    medians. Decode: the tokens after the first over the time from the first token to the last
    (GenerationResult.decode_tokens_per_s, measured alike for plain and speculative decoding).
    Call: every token over the call's wall time, prefill and the call's setup included. One call
    of a short reply varies by 10-20% from run to run on the H100."""
    rjax.generate(model, prompt, **kw)
    decode, call = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = rjax.generate(model, prompt, **kw)
        call.append(len(r.tokens) / (time.perf_counter() - t0))
        decode.append(r.decode_tokens_per_s)
    return r, float(np.median(decode)), float(np.median(call))


@functools.cache
def _cost_loop(cfg, T: int, passes: int):
    """A program of `passes` forward passes of T positions (batch 1) after `held` cached ones."""
    dtype = activation_dtype()

    @functools.partial(jax.jit, donate_argnums=(1,), compiler_options=engine.DECODE_LOOP_COMPILER_OPTIONS)
    def loop(params, cache, tokens, held):
        pos = held + jnp.arange(T, dtype=jnp.int32)[None]

        def body(i, carry):
            acc, cache = carry
            logits, cache = forward(cfg, params, cache, tokens, pos, None, dtype)
            return acc + logits[0, -1, 0], cache

        return jax.lax.fori_loop(0, passes, body, (jnp.float32(0), cache))

    return loop


def forward_cost(cfg, params, T: int, held: int, max_len: int, passes: int = 32) -> float:
    """Seconds per forward pass of T positions after `held` cached ones (batch 1), timed as one
    program of `passes` passes (its first call compiles it and is not timed)."""
    loop = _cost_loop(cfg, T, passes)
    tokens, held = jnp.ones((1, T), jnp.int32), jnp.int32(held)
    acc, cache = loop(params, init_cache(cfg, 1, max_len, activation_dtype()), tokens, held)
    acc.block_until_ready()
    t0 = time.perf_counter()
    acc, cache = loop(params, cache, tokens, held)
    acc.block_until_ready()
    return (time.perf_counter() - t0) / passes


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None if they are equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per round when each draft is accepted with probability alpha, independently."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def lookup_rounds(prompt: list[int], reply: list[int], k: int, drafter=None) -> tuple[float, int, int]:
    """Prompt lookup with K = k replayed over `reply` (plain greedy decoding's tokens after
    `prompt`), each round keeping the draft's agreeing prefix and the target's next token: with
    `drafter`'s draft (NgramDrafter.draft), or with drafter None the longest agreeing
    continuation of any earlier occurrence of the sequence's last token, a bound no rule that
    drafts what followed a match of the sequence's last tokens can pass.
    -> (tokens per round, rounds, rounds that kept no drafted token)."""
    seq, i, rounds, idle = list(prompt), 0, 0, 0
    while i < len(reply):
        ahead = reply[i:i + k]
        if drafter is not None:
            cands = [drafter.draft(seq, k)]
        else:
            cands = [seq[s + 1:s + 1 + k] for s in range(len(seq) - 1) if seq[s] == seq[-1]]
        m = max((next((j for j, (x, y) in enumerate(zip(d, ahead)) if x != y), min(len(d), len(ahead)))
                 for d in cands), default=0)
        seq += reply[i:i + m + 1]
        i, rounds, idle = i + m + 1, rounds + 1, idle + (m == 0)
    return len(reply) / max(rounds, 1), rounds, idle


def bound_speedup(reply_len: int, rounds: int, idle: int, step_s: float, verify_s: float) -> float:
    """The speedup of the bound's rounds over plain decoding, where a round that keeps no draft
    token costs one plain step (as if the rule had known to draft nothing there: the engine runs
    a plain step in a round without drafts) and every other round one verification."""
    return reply_len * step_s / (idle * step_s + (rounds - idle) * verify_s)


def part_ngram(a, out: dict) -> None:
    say(f"(a) prompt lookup on {a.model}")
    t0 = time.perf_counter()
    model = rjax.load(a.model, progress=False)
    rows = []
    for name, prompt in PROMPTS.items():
        kw = dict(max_new_tokens=a.max_new_tokens)
        plain, plain_tps, plain_call = timed_generate(model, prompt, steps_per_dispatch=32, **kw)
        n_prompt = len(plain.prompt_tokens)
        row = dict(prompt=name, prompt_tokens=n_prompt, generated=len(plain.tokens), plain_tokens_per_s=plain_tps,
                   plain_call_tokens_per_s=plain_call, by_k={})
        S = len(plain.prompt_tokens) + a.max_new_tokens
        step_s = forward_cost(model.config, model.params, 1, n_prompt, engine.prompt_bucket(S))
        row["plain_step_s"] = step_s
        for k in a.ngram_k:
            spec, tps, call = timed_generate(model, prompt, speculative="ngram", draft_tokens=k,
                                              steps_per_dispatch=a.rounds_per_dispatch, **kw)
            s = spec.speculative
            verify_s = forward_cost(model.config, model.params, k + 1, n_prompt, engine.prompt_bucket(S))
            round_s = (len(spec.tokens) - 1) / tps / max(s["steps"], 1) if tps else None
            row["by_k"][k] = dict(
                tokens_per_s=tps, speedup=tps / plain_tps if plain_tps else None, same_tokens=spec.tokens == plain.tokens,
                first_difference=first_difference(spec.tokens, plain.tokens), call_tokens_per_s=call, call_speedup=call / plain_call if plain_call else None,
                steps=s["steps"], drafted=s["drafted"], accepted=s["accepted"],
                acceptance=s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
                tokens_per_round=(len(spec.tokens) - 1) / max(s["steps"], 1),
                verify_s=verify_s, round_s=round_s,
                lookup_and_overhead_s=None if round_s is None else round_s - verify_s)
            r = row["by_k"][k]
            # What the reply allows: the drafter's and the best lookup's tokens per round on plain
            # decoding's reply, and the speedup that bound gives at the measured pass costs.
            r["lookup_tokens_per_round"] = lookup_rounds(plain.prompt_tokens, plain.tokens, k, NgramDrafter())[0]
            r["bound_tokens_per_round"], rounds, idle = lookup_rounds(plain.prompt_tokens, plain.tokens, k)
            r["bound_speedup"] = bound_speedup(len(plain.tokens), rounds, idle, step_s, verify_s)
            say(f"  {name} K={k}: {tps:,.0f} tok/s vs plain {plain_tps:,.0f} ({r['speedup']:.2f}x), "
                f"accepted {s['accepted']}/{s['drafted']}, {r['tokens_per_round']:.2f} tokens/round, "
                f"same tokens: {_same(r)}")
        rows.append(row)
    out["ngram"] = dict(model=str(model.source), rows=rows, seconds=time.perf_counter() - t0)


def part_draft_model(a, out: dict) -> None:
    from rjax.loading.synth import write_synthetic

    t0 = time.perf_counter()
    layers = "" if a.target_layers is None else f"-{a.target_layers}l"
    path = Path(a.workdir) / f"{a.target_shape}{layers}-q8_0.gguf"
    if not path.exists():
        say(f"(b) writing the synthetic {a.target_shape} Q8_0 to {path}")
        write_synthetic(path, a.target_shape, "q8_0", seed=0, n_layers=a.target_layers, tokenizer_from="builtin")
    write_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    target = rjax.load(path, progress=False)
    load_s = time.perf_counter() - t1
    t1 = time.perf_counter()
    draft = rjax.load(path, progress=False, requantize="q4_0")
    jax.block_until_ready(draft.params)
    draft_load_s = time.perf_counter() - t1
    say(f"(b) loaded the target in {load_s:.1f} s and its Q4_0 copy in {draft_load_s:.1f} s")
    prompt = "The history of the city begins with a small settlement by the river, " * 4
    kw = dict(raw=True, max_new_tokens=a.max_new_tokens)
    plain, plain_tps, _ = timed_generate(target, prompt, steps_per_dispatch=32, **kw)
    n_prompt = len(plain.prompt_tokens)
    S = engine.prompt_bucket(n_prompt + a.max_new_tokens)
    target_step_s = forward_cost(target.config, target.params, 1, n_prompt, S)
    draft_step_s = forward_cost(draft.config, draft.params, 1, n_prompt, S)
    res = dict(target=str(path), prompt_tokens=n_prompt, generated=len(plain.tokens), plain_tokens_per_s=plain_tps,
               target_step_s=target_step_s, draft_step_s=draft_step_s, write_s=write_s, load_s=load_s,
               draft_load_s=draft_load_s, by_k={})
    for k in a.draft_k:
        spec, tps, _ = timed_generate(target, prompt, speculative=draft, draft_tokens=k,
                                       steps_per_dispatch=a.rounds_per_dispatch, **kw)
        s = spec.speculative
        alpha = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        round_s = (len(spec.tokens) - 1) / tps / max(s["steps"], 1) if tps else None
        if k == "auto":   # K chosen per dispatch: its rate and the K it took, no single cost model
            res["by_k"][k] = dict(tokens_per_s=tps, speedup=tps / plain_tps if plain_tps else None,
                                  same_tokens=spec.tokens == plain.tokens, steps=s["steps"], drafted=s["drafted"],
                                  accepted=s["accepted"], acceptance=alpha, k_used=s["k_used"], round_s=round_s)
            say(f"  K=auto: {tps:,.0f} tok/s vs plain {plain_tps:,.0f}, acceptance {alpha:.2f}, K per dispatch "
                f"{s['k_used']}")
            continue
        verify_s = forward_cost(target.config, target.params, k + 1, n_prompt, S)
        model_round_s = k * draft_step_s + verify_s
        res["by_k"][k] = dict(
            tokens_per_s=tps, speedup=tps / plain_tps if plain_tps else None, same_tokens=spec.tokens == plain.tokens,
            first_difference=first_difference(spec.tokens, plain.tokens), steps=s["steps"], drafted=s["drafted"], accepted=s["accepted"], acceptance=alpha,
            tokens_per_round=(len(spec.tokens) - 1) / max(s["steps"], 1), verify_s=verify_s,
            draft_s_per_round=k * draft_step_s, round_s=round_s,
            other_s_per_round=None if round_s is None else round_s - model_round_s,
            predicted_speedup=expected_tokens(alpha, k) * target_step_s / model_round_s)
        r = res["by_k"][k]
        say(f"  K={k}: {tps:,.0f} tok/s vs plain {plain_tps:,.0f} ({r['speedup']:.2f}x), acceptance {alpha:.2f}, "
            f"predicted {r['predicted_speedup']:.2f}x; per round: draft {k * draft_step_s * 1e3:.2f} ms, verify "
            f"{verify_s * 1e3:.2f} ms, measured {round_s * 1e3 if round_s else 0:.2f} ms")
    res["seconds"] = time.perf_counter() - t0
    out["draft_model"] = res


def _same(r: dict) -> str:
    """yes, or @N: the position where the tokens first part from plain decoding's."""
    if r["same_tokens"]:
        return "yes"
    return f"@{r['first_difference']}" if r.get("first_difference") is not None else "no"


def table(out: dict) -> str:
    lines = []
    if "ngram" in out:
        lines += ["(a) prompt lookup, default model, batch 1, greedy",
                  "  decode: tokens after the first / first token to last; call: all tokens / the call's wall time",
                  "  lookup, bound: tokens per round on plain decoding's reply with the drafter's drafts, and with the "
                  "best continuation of any earlier occurrence of the last token; bound x: that bound's speedup at the measured step and "
                  "verify costs, a round that keeps no draft token costing a plain step",
                  f"{'prompt':16} {'K':>2} {'plain t/s':>9} {'spec t/s':>9} {'speedup':>7} {'call x':>6} {'accept':>6} "
                  f"{'tok/rnd':>7} {'lookup':>6} {'bound':>6} {'bound x':>7} {'verify ms':>9} {'round ms':>8} {'same':>4}"]
        for row in out["ngram"]["rows"]:
            for k, r in row["by_k"].items():
                lines.append(f"{row['prompt']:16} {k:>2} {row['plain_tokens_per_s']:>9,.0f} {r['tokens_per_s']:>9,.0f} "
                             f"{r['speedup']:>6.2f}x {r['call_speedup']:>5.2f}x {r['acceptance']:>6.2f} "
                             f"{r['tokens_per_round']:>7.2f} {r['lookup_tokens_per_round']:>6.2f} "
                             f"{r['bound_tokens_per_round']:>6.2f} {r['bound_speedup']:>6.2f}x {r['verify_s'] * 1e3:>9.3f} "
                             f"{(r['round_s'] or 0) * 1e3:>8.3f} "
                             f"{_same(r):>4}")
    if "draft_model" in out:
        d = out["draft_model"]
        lines += ["", f"(b) {Path(d['target']).stem} drafted by its own Q4_0 copy, batch 1, greedy "
                      f"(target step {d['target_step_s'] * 1e3:.2f} ms, draft step {d['draft_step_s'] * 1e3:.2f} ms)",
                  f"{'K':>2} {'plain t/s':>9} {'spec t/s':>9} {'speedup':>7} {'predicted':>9} {'accept':>6} "
                  f"{'draft ms':>8} {'verify ms':>9} {'other ms':>8} {'same':>4}"]
        for k, r in d["by_k"].items():
            if k == "auto":
                lines.append(f"{'a':>2} {d['plain_tokens_per_s']:>9,.0f} {r['tokens_per_s']:>9,.0f} "
                             f"{r['speedup']:>6.2f}x {'-':>9} {r['acceptance']:>6.2f}   K per dispatch: "
                             f"{','.join(map(str, r['k_used']))}")
                continue
            lines.append(f"{k:>2} {d['plain_tokens_per_s']:>9,.0f} {r['tokens_per_s']:>9,.0f} {r['speedup']:>6.2f}x "
                         f"{r['predicted_speedup']:>8.2f}x {r['acceptance']:>6.2f} {r['draft_s_per_round'] * 1e3:>8.2f} "
                         f"{r['verify_s'] * 1e3:>9.2f} {(r['other_s_per_round'] or 0) * 1e3:>8.2f} "
                         f"{_same(r):>4}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".", help="directory for speculative.json")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the default model: catalog name or .gguf path")
    p.add_argument("--workdir", default="/tmp/rjax-speculative", help="where the synthetic llama-8b is written")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ngram-k", default="4,7,15", help="draft tokens per round for prompt lookup (comma list; 15, "
                   "rjax.generate's default for the default model, keeps the K + 1 verified positions on the decode "
                   "attention kernel)")
    p.add_argument("--draft-k", default="4,auto", help="draft tokens per round for the draft model (comma list; "
                                                     "'auto': chosen per dispatch from the acceptance rate)")
    p.add_argument("--rounds-per-dispatch", type=int, default=32,
                   help="speculative rounds per program call (plain decoding runs 32 steps per call)")
    p.add_argument("--skip-8b", action="store_true", help="only part (a)")
    p.add_argument("--skip-ngram", action="store_true", help="only part (b)")
    p.add_argument("--target-shape", default="llama-8b", help="part (b)'s synthetic shape (rjax.loading.synth.SHAPES)")
    p.add_argument("--target-layers", type=int, default=None, help="part (b)'s layer count (default: the shape's)")
    a = p.parse_args(argv)
    a.ngram_k = [int(k) for k in a.ngram_k.split(",")]
    a.draft_k = [k if k == "auto" else int(k) for k in a.draft_k.split(",")]
    os.makedirs(a.out, exist_ok=True)
    dev = jax.devices()[0]
    out: dict = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                     max_new_tokens=a.max_new_tokens)
    say(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    dest = Path(a.out) / "speculative.json"
    parts = (() if a.skip_ngram else (part_ngram,)) + (() if a.skip_8b else (part_draft_model,))
    for part in parts:
        try:
            part(a, out)
        except Exception as e:  # keep what the other part measured
            out.setdefault("errors", []).append(f"{part.__name__}: {type(e).__name__}: {e}")
            say(f"{part.__name__} failed: {type(e).__name__}: {e}")
        dest.write_text(json.dumps(out, indent=2, default=str))
    print(table(out), flush=True)
    return 1 if out.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())

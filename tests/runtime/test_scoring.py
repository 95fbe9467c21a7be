"""Scoring and perplexity on the default model against transformers' logits for the same GGUF.

The reference log-probabilities are log_softmax (float64, numpy) of the oracle's float32 logits
at every position of the same token windows rjax evaluates; the reference perplexities apply
llama.cpp's chunk rule and Hugging Face's strided rule, written out again here, to those.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from rjax.runtime import scoring
from tests.oracle.client import oracle_logits

pytestmark = pytest.mark.oracle

TEXT_FILE = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"
CTX, STRIDE, BATCH = 128, 64, 2
# Logits agree with transformers within 1e-3 x max|logit| (test_llama_oracle); a log-probability
# moves by at most twice the largest logit error. Measured here: max |Δ log p| ≈ 3e-5.
LOGPROB_ATOL = 2e-3
CONTEXT = "The keeper of the lighthouse wrote down the weather"
CONTINUATIONS = [" every night.", " once a year, in a small red notebook.", " and the birds"]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _next_token_logprobs(ids, logits) -> np.ndarray:
    """ref[t] = log p(ids[t+1] | ids[:t+1]) from all-position logits [T, V]."""
    lp = _log_softmax(logits)
    return lp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


@pytest.fixture(scope="module")
def case(smollm2_path, smollm2):
    ids = smollm2.tokenizer.encode(TEXT_FILE.read_text(encoding="utf-8"))
    assert not smollm2.tokenizer.add_bos and len(ids) >= 2 * CTX + STRIDE, len(ids)
    # Every window either perplexity mode evaluates (the model adds no BOS, so llama.cpp's chunks
    # are plain slices and coincide with some strided windows), plus the scoring pairs.
    windows = {tuple(w.tokens) for w in scoring.llama_cpp_windows(ids, CTX, None)}
    windows |= {tuple(w.tokens) for w in scoring.strided_windows(ids, CTX, STRIDE)}
    pairs = [scoring.split_pair(smollm2.tokenizer, CONTEXT, c) for c in CONTINUATIONS]
    prompts = sorted(windows) + [tuple(p + c) for p, c in pairs]
    ref = oracle_logits(smollm2_path, [list(p) for p in prompts], 0, all_positions=True)
    ref_lp = {p: _next_token_logprobs(p, r["all_logits"]) for p, r in zip(prompts, ref)}
    return ids, ref_lp, pairs


def test_token_logprobs_match_transformers(case, smollm2):
    ids, ref_lp, _ = case
    windows = scoring.strided_windows(ids, CTX, STRIDE)
    assert len(windows[-1].tokens) < CTX  # the last row is padded
    # [BATCH, CTX] rows, the shape the perplexity tests compile for too.
    for b in range(0, len(windows), BATCH):
        group = windows[b: b + BATCH]
        tokens = np.zeros((BATCH, CTX), np.int32)
        lengths = np.ones((BATCH,), np.int32)
        for i, w in enumerate(group):
            tokens[i, : len(w.tokens)] = w.tokens
            lengths[i] = len(w.tokens)
        lp = np.asarray(rjax.token_logprobs(smollm2.config, smollm2.params, jnp.asarray(tokens), jnp.asarray(lengths)))
        assert lp.shape == (BATCH, CTX - 1)
        for i, w in enumerate(group):
            ref = ref_lp[tuple(w.tokens)]
            err = np.max(np.abs(lp[i, : len(ref)] - ref))
            assert err <= LOGPROB_ATOL, f"window {b + i}: max|Δ log p| {err:.3g} > {LOGPROB_ATOL}"
            assert np.all(lp[i, len(ref):] == 0.0), f"window {b + i}: padding positions must score 0"


def _reference_llama_cpp(ids, ref_lp, n_ctx):
    """llama.cpp's perplexity(): chunk k is ids[k*n_ctx:(k+1)*n_ctx] (no BOS for this model); the
    logits at positions first..n_ctx-2 (first = n_ctx/2) are scored against the next tokens."""
    first = n_ctx // 2
    nll = []
    for k in range(len(ids) // n_ctx):
        chunk = tuple(ids[k * n_ctx: (k + 1) * n_ctx])
        nll.extend(-ref_lp[chunk][first: n_ctx - 1])
    return np.asarray(nll)


def _reference_strided(ids, ref_lp, n_ctx, stride):
    """transformers' documented loop: window [begin, begin+n_ctx), the last trg_len = end - prev_end
    labels scored (never the window's first token)."""
    nll, prev_end = [], 0
    for begin in range(0, len(ids), stride):
        end = min(begin + n_ctx, len(ids))
        trg_len = end - prev_end
        window = tuple(ids[begin:end])
        lp = ref_lp[window]  # lp[t] predicts window[t + 1]
        first_label = max(len(window) - trg_len, 1)
        nll.extend(-lp[first_label - 1:])
        prev_end = end
        if end == len(ids):
            break
    return np.asarray(nll)


def _stats(nll):
    mean = nll.mean()
    ppl = math.exp(mean)
    return ppl, math.sqrt(((nll ** 2).mean() - mean ** 2) / (len(nll) - 1)) * ppl


def test_perplexity_llama_cpp_chunks_match_transformers(case, smollm2):
    ids, ref_lp, _ = case
    text = TEXT_FILE.read_text(encoding="utf-8")
    r = rjax.perplexity(smollm2, text, ctx=CTX, batch=BATCH, progress=False)
    ref_nll = _reference_llama_cpp(ids, ref_lp, CTX)
    ref_ppl, ref_std = _stats(ref_nll)
    assert (r.n_windows, r.n_scored, r.n_tokens) == (len(ids) // CTX, len(ref_nll), len(ids))
    assert r.n_scored == (len(ids) // CTX) * (CTX - CTX // 2 - 1)
    assert abs(r.ppl / ref_ppl - 1) < 0.01, (r.ppl, ref_ppl)
    assert abs(r.ppl_std / ref_std - 1) < 0.05, (r.ppl_std, ref_std)
    np.testing.assert_allclose(r.token_nll, ref_nll, atol=LOGPROB_ATOL)


def test_perplexity_strided_matches_transformers(case, smollm2):
    ids, ref_lp, _ = case
    text = TEXT_FILE.read_text(encoding="utf-8")
    r = rjax.perplexity(smollm2, text, ctx=CTX, stride=STRIDE, batch=BATCH, progress=False)
    ref_nll = _reference_strided(ids, ref_lp, CTX, STRIDE)
    assert r.n_scored == len(ids) - 1 == len(ref_nll)
    ref_ppl, _ = _stats(ref_nll)
    assert abs(r.ppl / ref_ppl - 1) < 0.01, (r.ppl, ref_ppl)
    np.testing.assert_allclose(r.token_nll, ref_nll, atol=LOGPROB_ATOL)


def test_cli_perplexity_prints_the_api_number(case, smollm2, smollm2_path):
    from rjax.cli.main import build_parser

    # The subcommand as `rjax` parses and runs it (cli.main would also switch this process to the
    # persistent compilation cache, which other tests in the worker should not inherit).
    args = build_parser().parse_args(["perplexity", "-m", str(smollm2_path), str(TEXT_FILE), "--ctx", str(CTX),
                                      "--batch", str(BATCH), "--json"])
    out = io.StringIO()
    with redirect_stdout(out):
        assert args.func(args) == 0
    got = json.loads(out.getvalue())
    ids, ref_lp, _ = case
    ref_ppl, _ = _stats(_reference_llama_cpp(ids, ref_lp, CTX))
    assert abs(got["ppl"] / ref_ppl - 1) < 0.01 and got["n_ctx"] == CTX and got["stride"] is None


def test_score_continuations_match_transformers(case, smollm2):
    _, ref_lp, pairs = case
    scores = rjax.score(smollm2, CONTEXT, CONTINUATIONS)
    assert [s.text for s in scores] == CONTINUATIONS
    for s, (p, c) in zip(scores, pairs):
        assert s.tokens == c and s.token_logprobs.shape == (len(c),)
        ref = ref_lp[tuple(p + c)][len(p) - 1:]
        np.testing.assert_allclose(s.token_logprobs, ref, atol=LOGPROB_ATOL)
        assert abs(float(s) - ref.sum()) <= LOGPROB_ATOL * len(c)


def _first_layers(cfg, params, n):
    """The model cut to its first n layers: the same kinds of arrays, a fraction of the compile time."""
    cfg = dataclasses.replace(cfg, n_layers=n, layer_windows=cfg.layer_windows[:n],
                              layer_rope_theta=cfg.layer_rope_theta[:n], layer_rope_linear=cfg.layer_rope_linear[:n])
    return cfg, dataclasses.replace(params, layers=params.layers[:n])


def test_jit_and_vmap_agree_with_the_batched_call(case, smollm2):
    """The core composes with user transformations: a jitted vmap over single sequences gives
    the batched numbers, and continuation_logprob sums the right slice. (Two layers of the
    model: composition is what is tested here, the full model's numbers are tested above.)"""
    _, _, pairs = case
    cfg, params = _first_layers(smollm2.config, smollm2.params, 2)
    seqs = [p + c for p, c in pairs]
    T = rjax.prompt_bucket(max(map(len, seqs)))
    tokens = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.array([len(s) for s in seqs], np.int32)
    starts = np.array([len(p) for p, _ in pairs], np.int32)
    tokens, lengths, starts = map(jnp.asarray, (tokens, lengths, starts))

    batched = np.asarray(rjax.token_logprobs(cfg, params, tokens, lengths))
    expect = [float(np.sum(batched[i, s - 1: n - 1])) for i, (s, n) in enumerate(zip(starts, lengths))]

    # A user's jitted, vmapped function of one (tokens, length, start) example at a time.
    @jax.jit
    @jax.vmap
    def one_example(t, n, s):
        return scoring.continuation_logprob(cfg, params, t[None], n[None], s[None])[0]

    totals = np.asarray(one_example(tokens, lengths, starts))
    np.testing.assert_allclose(totals, expect, atol=1e-4)
    assert int(np.argmax(totals)) == int(np.argmax(expect))
    # Padding is ignored: the same sequences in a longer buffer score the same.
    wider = jnp.pad(tokens, ((0, 0), (0, T)), constant_values=7)
    np.testing.assert_allclose(np.asarray(rjax.token_logprobs(cfg, params, wider, lengths))[:, : T - 1], batched,
                               atol=1e-4)


def test_llama_cpp_windows_replace_the_first_token_with_bos():
    ids = list(range(100, 126))  # 26 tokens: 3 chunks of 8, 2 left over
    w = scoring.llama_cpp_windows(ids, 8, bos_id=1)
    assert [x.tokens for x in w] == [[1, *range(101, 108)], [1, *range(109, 116)], [1, *range(117, 124)]]
    assert all(x.first_target == 5 for x in w)  # logits at 4..6 score tokens 5..7: 8 - 4 - 1 = 3 per chunk
    assert [x.tokens for x in scoring.llama_cpp_windows(ids, 8, None)][1] == list(range(108, 116))


@pytest.mark.parametrize("n,ctx,stride", [(2, 4, 4), (26, 8, 3), (26, 8, 8), (31, 8, 1), (9, 16, 5), (40, 8, 7)])
def test_strided_windows_score_every_token_once(n, ctx, stride):
    ids = list(range(n))
    scored, starts = [], []
    for w in scoring.strided_windows(ids, ctx, stride):
        assert len(w.tokens) <= ctx and w.tokens == list(range(w.tokens[0], w.tokens[-1] + 1))
        assert w.first_target >= 1
        if w.tokens[0] > 0:
            assert w.first_target >= min(ctx - stride, len(w.tokens) - 1)  # context kept per token
        starts.append(w.tokens[0])
        scored += w.tokens[w.first_target:]
    # Each token once; with disjoint windows (stride = ctx) a window's first token has no context.
    skipped = {0} | (set(starts) if stride == ctx else set())
    assert scored == [t for t in ids if t not in skipped]


def test_errors_name_the_limit(smollm2):
    with pytest.raises(ValueError, match="needs at least 128"):
        rjax.perplexity(smollm2, "Too short.", ctx=128, progress=False)
    with pytest.raises(ValueError, match="stride must be between 1 and the context"):
        scoring.strided_windows(list(range(50)), 16, 17)
    with pytest.raises(ValueError, match="context length 8192"):
        scoring.score_ids(smollm2.config, smollm2.params, [[1] * 8192], [[2]])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        scoring.score_ids(smollm2.config, smollm2.params, [[]], [[2]])

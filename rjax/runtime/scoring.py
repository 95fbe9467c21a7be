"""Scoring text under the model: log-probabilities of given tokens, perplexity, and embeddings.

The core is one pure function, `token_logprobs(cfg, params, tokens, lengths)`: the log-probability
of every next token of a right-padded batch, computed in one forward pass over a fresh KV cache
(made inside the function, so the function takes and returns plain arrays and composes with
`jax.jit`, `jax.vmap` and `jax.grad`). Everything else here is host-side bookkeeping around it:
which tokens to score (`score_ids`, `score`), and which windows of a long text to evaluate
(`perplexity`, in llama.cpp's chunked scheme or Hugging Face's strided sliding window).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rjax.engine.steps import program_params, prompt_bucket
from rjax.loading.catalog import add_model_argument
from rjax.loading.loaders import load
from rjax.loading.programs import device_program
from rjax.math.cache import check_kv_dtype, init_cache
from rjax.math.config import ModelConfig
from rjax.math.model import hidden_states, logits_from_hidden
from rjax.math.params import Params
from rjax.math.tensor_parallel import place_cache
from rjax.runtime.generation import activation_dtype, check_text
from rjax.runtime.request import check_token_ids

# Largest [rows, vocab] float32 logits block materialized at once (64 MiB): long batches are
# scored a block of positions at a time so the full [B, T, vocab] logits never exist.
_LOGITS_BLOCK_BYTES = 1 << 26


def _target_logprobs(params: Params, h: jax.Array, targets: jax.Array) -> jax.Array:
    """log_softmax(logits)[target] for hidden states h [B, T, d] and targets [B, T] -> [B, T]."""
    B, T, d = h.shape
    vocab = (params.embed if params.lm_head is None else params.lm_head).shape[0]
    block = max(1, min(T, _LOGITS_BLOCK_BYTES // (4 * B * vocab)))
    n = -(-T // block)
    pad = n * block - T
    hb = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, n, block, d).swapaxes(0, 1)
    tb = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, block).swapaxes(0, 1)

    def one_block(args):
        hc, tc = args
        logp = jax.nn.log_softmax(logits_from_hidden(params, hc), axis=-1)
        return jnp.take_along_axis(logp, tc[..., None], axis=-1)[..., 0]

    out = jax.lax.map(one_block, (hb, tb))  # [n, B, block]
    return out.swapaxes(0, 1).reshape(B, n * block)[:, :T]


def token_logprobs(cfg: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
                   dtype=jnp.float32, kv_dtype: str | None = None) -> jax.Array:
    """Log-probabilities of each next token: tokens [B, T] int32 (right-padded), lengths [B].

    -> [B, T-1] float32, out[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]) for t + 1 < lengths[b],
    0 past the end of a sequence. Positions start at 0 in every row. A fresh KV cache of T
    positions is built inside (T must not exceed the model's context length); `dtype` is the
    activation dtype (float32 matches the float32 reference; bfloat16 suits accelerators);
    `kv_dtype` how the cache stores K/V ("bf16": unquantized; "int8", "fp8": quantized when
    written, so the positions attend to quantized keys and values, as decoding would).
    Jitted (cfg, dtype and kv_dtype static); callable under the caller's jit, vmap and grad.
    """
    # One calling convention into the jitted function, so that however dtype is given (by
    # position, by keyword, by default, as a class or a dtype) the compiled program is shared.
    return _token_logprobs(cfg, params, tokens, lengths, jnp.dtype(dtype), check_kv_dtype(kv_dtype))


@device_program(static_argnums=(0, 4, 5))
def _token_logprobs(cfg, params, tokens, lengths, dtype, kv_dtype="bf16"):
    B, T = tokens.shape
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = jnp.where(t < lengths[:, None], t, -1)
    cache = place_cache(init_cache(cfg, B, T, dtype, kv_dtype), params.tp)
    h, _ = hidden_states(cfg, params, cache, tokens, pos, None, dtype)
    lp = _target_logprobs(params, h[:, :-1], tokens[:, 1:])
    return jnp.where(t[:, 1:] < lengths[:, None], lp, 0.0)


def continuation_logprob(cfg: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
                         starts: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Summed log-probability of tokens[b, starts[b]:lengths[b]] given what precedes them -> [B].

    `starts[b]` is where the continuation begins (>= 1: the first token is never predicted).
    Pure and traceable like `token_logprobs`.
    """
    lp = token_logprobs(cfg, params, tokens, lengths, dtype)
    target = jnp.arange(1, tokens.shape[1], dtype=jnp.int32)[None, :]
    return jnp.sum(jnp.where(target >= jnp.asarray(starts)[:, None], lp, 0.0), axis=-1)


@device_program(static_argnums=(0, 4))
def pooled_embeddings(cfg: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array, dtype=jnp.float32):
    """Embeddings of a right-padded batch (tokens [B, T], lengths [B] >= 1) -> [B, d_model]
    float32: the final-normed hidden states averaged over each sequence's tokens (mean pooling,
    as sentence-transformers pools; a causal model's last token alone sees the whole text too,
    but the mean is steadier for a model not trained to embed), L2-normalized. A fresh cache of
    T positions is made inside, as for `token_logprobs`."""
    B, T = tokens.shape
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = jnp.where(t < lengths[:, None], t, -1)
    cache = place_cache(init_cache(cfg, B, T, dtype), params.tp)
    h, _ = hidden_states(cfg, params, cache, tokens, pos, None, dtype)
    valid = (pos >= 0)[..., None]
    mean = jnp.sum(jnp.where(valid, h.astype(jnp.float32), 0.0), axis=1) / jnp.maximum(lengths, 1)[:, None]
    return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


def embed_ids(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *, max_tokens: int | None = None,
              batch: int = 8, dtype=None) -> np.ndarray:
    """`pooled_embeddings` of token-id sequences -> [N, d_model] float32, `batch` at a time
    (padded to power-of-two counts and prompt length buckets, so few programs compile).
    ValueError for an empty sequence, an id outside the vocabulary, or more than `max_tokens`
    (default: the context length) tokens, naming the input."""
    limit = cfg.context_length if max_tokens is None else min(max_tokens, cfg.context_length)
    seqs = []
    for i, p in enumerate(prompts):
        ids = check_token_ids(p, cfg.vocab_size, f"input[{i}]")
        if not ids:
            raise ValueError(f"input[{i}] is empty: an embedding needs at least one token")
        if len(ids) > limit:
            raise ValueError(f"input[{i}] has {len(ids)} tokens; at most {limit} can be embedded")
        seqs.append(ids)
    out = []
    for at in range(0, len(seqs), batch):
        part = seqs[at: at + batch]
        B, T = 1 << (len(part) - 1).bit_length(), min(prompt_bucket(max(map(len, part))), limit)
        tokens = np.zeros((B, T), np.int32)
        lengths = np.ones(B, np.int32)   # padding rows: one token, dropped
        for i, s in enumerate(part):
            tokens[i, : len(s)], lengths[i] = s, len(s)
        e = pooled_embeddings(cfg, params, jnp.asarray(tokens), jnp.asarray(lengths), dtype or activation_dtype())
        out.append(np.asarray(e)[: len(part)])
    return np.concatenate(out) if out else np.zeros((0, cfg.d_model), np.float32)


def _check_fits(cfg: ModelConfig, n: int, what: str) -> None:
    if n > cfg.context_length:
        raise ValueError(f"{what} has {n} tokens, more than the model's context length {cfg.context_length}")


def score_ids(cfg: ModelConfig, params: Params, prompt_ids: Sequence[Sequence[int]],
              continuation_ids: Sequence[Sequence[int]], dtype=None) -> list[np.ndarray]:
    """Per-token log-probabilities of each continuation after its prompt, all pairs in one call.

    prompt_ids[i] + continuation_ids[i] is one sequence; the pairs are right-padded to a shared
    length bucket (so nearby lengths reuse one compiled program). Returns, per pair, a float32
    array [len(continuation_ids[i])] of log p(continuation token | everything before it).
    """
    if len(prompt_ids) != len(continuation_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(continuation_ids)} continuations")
    seqs = []
    for i, (p, c) in enumerate(zip(prompt_ids, continuation_ids)):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: the first continuation token needs a context (e.g. BOS)")
        seqs.append(check_token_ids(p, cfg.vocab_size, f"prompt {i}")
                    + check_token_ids(c, cfg.vocab_size, f"continuation {i}"))
        _check_fits(cfg, len(seqs[-1]), f"prompt + continuation {i}")
    T = min(prompt_bucket(max(len(s) for s in seqs)), cfg.context_length)
    tokens = np.zeros((len(seqs), T), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.array([len(s) for s in seqs], np.int32)
    lp = np.asarray(token_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                   dtype or activation_dtype()))
    # Token j of sequence i is predicted at output column j - 1.
    return [lp[i, len(p) - 1: len(s) - 1].copy() for i, (p, s) in enumerate(zip(prompt_ids, seqs))]


@dataclasses.dataclass(frozen=True)
class ContinuationScore:
    """How likely the model finds one continuation of a context."""

    text: str
    tokens: list[int]             # the continuation's token ids
    token_logprobs: np.ndarray    # [len(tokens)] log p(token | context and the tokens before it)

    @property
    def logprob(self) -> float:
        """Sum of the token log-probabilities: log p(continuation | context)."""
        return float(np.sum(self.token_logprobs, dtype=np.float64))

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(len(self.tokens), 1)

    def __float__(self) -> float:
        return self.logprob


def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of context and continuation as the tokenizer splits the joined text.

    Trailing whitespace of the context moves to the continuation (byte-level BPE glues a space
    to the following word), the joined text is tokenized once, and the continuation is what
    follows the context's own tokens; the context gets BOS as the model's tokenizer says. An
    empty context becomes BOS alone, which needs a model with a BOS token.
    """
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    context = stripped
    ctx_ids = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    if whole[: len(ctx_ids)] != ctx_ids:
        # The join changed how the context itself tokenizes: score the pieces tokenized apart.
        cont_ids = tokenizer.encode(continuation, add_bos=False)
    else:
        cont_ids = whole[len(ctx_ids):]
    if not ctx_ids:
        if tokenizer.bos_id is None:
            raise ValueError("empty context and the tokenizer has no BOS token to condition on")
        ctx_ids = [tokenizer.bos_id]
    return ctx_ids, cont_ids


def score(model, context: str, continuations: Sequence[str] | str) -> list[ContinuationScore]:
    """Score continuations of one context: all of them in one batched forward pass.

    Returns one `ContinuationScore` per continuation; `.logprob` (also `float(s)`) is the summed
    log-probability, `.token_logprobs` the per-token array, `.tokens` the ids scored.
    """
    context = check_text(context, "context")
    if isinstance(continuations, (str, bytes, bytearray)):
        continuations = [continuations]
    continuations = [check_text(c, f"continuation {i}") for i, c in enumerate(continuations)]
    if not continuations:
        raise ValueError("no continuations to score")
    pairs = [split_pair(model.tokenizer, context, c) for c in continuations]
    for c, (_, ids) in zip(continuations, pairs):
        if not ids:
            raise ValueError(f"continuation {c!r} tokenizes to nothing")
    lps = score_ids(model.config, model.params, [p for p, _ in pairs], [c for _, c in pairs])
    return [ContinuationScore(text, ids, lp) for text, (_, ids), lp in zip(continuations, pairs, lps)]


# --- perplexity ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Window:
    """A run of tokens evaluated from position 0; tokens[first_target:] are scored."""

    tokens: list[int]
    first_target: int


def llama_cpp_windows(tokens: Sequence[int], n_ctx: int, bos_id: int | None) -> list[Window]:
    """The chunks llama.cpp's `llama-perplexity` evaluates (its default mode, no --ppl-stride).

    The token list is cut into len(tokens) // n_ctx non-overlapping chunks of n_ctx tokens (the
    remainder is dropped). When the tokenizer adds BOS, the first token of every chunk is
    *replaced* by BOS. The logits at positions n_ctx//2 .. n_ctx-2 of a chunk are scored against
    the tokens that follow them, so each chunk scores its last n_ctx - n_ctx//2 - 1 tokens,
    always with at least half a window of context.
    """
    if n_ctx < 4:
        raise ValueError(f"context of {n_ctx} tokens is too small to score (at least 4)")
    if len(tokens) < n_ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; a context of {n_ctx} needs at least {n_ctx}")
    out = []
    for i in range(len(tokens) // n_ctx):
        chunk = [int(t) for t in tokens[i * n_ctx: (i + 1) * n_ctx]]
        if bos_id is not None:
            chunk[0] = int(bos_id)
        out.append(Window(chunk, n_ctx // 2 + 1))
    return out


def strided_windows(tokens: Sequence[int], n_ctx: int, stride: int) -> list[Window]:
    """Hugging Face's strided sliding window (transformers' "Perplexity of fixed-length models").

    Windows of up to n_ctx tokens start every `stride` tokens; each scores only the tokens the
    previous window did not reach, with n_ctx - stride tokens of context or more. A window's
    first token has no context inside it and is never scored: with stride < n_ctx every token
    but the text's first is scored exactly once; with stride = n_ctx (disjoint windows) the
    first token of every window is skipped, as in transformers' loop.
    """
    if not 1 <= stride <= n_ctx:
        raise ValueError(f"stride must be between 1 and the context ({n_ctx}), got {stride}")
    if len(tokens) < 2:
        raise ValueError(f"the text has {len(tokens)} tokens; perplexity needs at least 2")
    out, prev_end = [], 0
    for begin in range(0, len(tokens), stride):
        end = min(begin + n_ctx, len(tokens))
        window = [int(t) for t in tokens[begin:end]]
        out.append(Window(window, max(1, len(window) - (end - prev_end))))
        prev_end = end
        if end == len(tokens):
            break
    return out


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    ppl_std: float          # uncertainty of ppl, as llama.cpp reports it ("PPL = x +/- y")
    nll: float              # mean negative log-likelihood per scored token (nats)
    n_scored: int           # tokens scored
    n_tokens: int           # tokens in the text
    n_windows: int
    n_ctx: int
    stride: int | None      # None: llama.cpp's chunks
    token_nll: np.ndarray   # [n_scored] per scored token, in text order

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("token_nll")
        return d


def _ppl_stats(nll: np.ndarray) -> tuple[float, float, float]:
    """(ppl, its uncertainty, mean nll) from per-token nll, as llama.cpp's final estimate."""
    mean = float(np.mean(nll, dtype=np.float64))
    ppl = math.exp(mean)
    var = float(np.mean(np.square(nll, dtype=np.float64))) - mean * mean
    std = math.sqrt(var / (len(nll) - 1)) * ppl if var > 0 and len(nll) > 1 else float("nan")
    return ppl, std, mean


def window_nll(cfg: ModelConfig, params: Params, windows: Sequence[Window], *, batch: int = 4,
               dtype=None, progress: bool = True, desc: str = "perplexity", kv_dtype: str | None = None) -> np.ndarray:
    """Negative log-likelihood of every scored token of every window, in order (float64).

    Windows run `batch` at a time, padded to the longest window, so a whole evaluation compiles
    once; a short last batch is filled with copies of its first window (their results dropped).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    T = max(len(w.tokens) for w in windows)
    _check_fits(cfg, T, "a perplexity window")
    dtype = dtype or activation_dtype()
    if len(windows) > batch:  # several calls: convert the weights once (see program_params)
        params = program_params(params, dtype)
    parts: list[np.ndarray] = []
    total, count = 0.0, 0
    bar = tqdm(total=len(windows), desc=desc, unit="window", disable=not progress, leave=False)
    try:
        for i in range(0, len(windows), batch):
            group = list(windows[i: i + batch])
            rows = group + [group[0]] * (batch - len(group))
            tokens = np.zeros((batch, T), np.int32)
            for r, w in enumerate(rows):
                tokens[r, : len(w.tokens)] = w.tokens
            lengths = np.array([len(w.tokens) for w in rows], np.int32)
            lp = np.asarray(token_logprobs(cfg, params, jnp.asarray(tokens), jnp.asarray(lengths), dtype, kv_dtype))
            for r, w in enumerate(group):
                nll = -lp[r, w.first_target - 1: len(w.tokens) - 1].astype(np.float64)
                parts.append(nll)
                total += float(nll.sum())
                count += len(nll)
            bar.update(len(group))
            bar.set_postfix(ppl=f"{math.exp(total / max(count, 1)):.4f}")
    finally:
        bar.close()
    return np.concatenate(parts) if parts else np.zeros((0,), np.float64)


def perplexity_of_ids(cfg: ModelConfig, params: Params, tokens: Sequence[int], *, ctx: int = 512,
                      stride: int | None = None, bos_id: int | None = None, batch: int = 4, dtype=None,
                      progress: bool = True, kv_dtype: str | None = None) -> PerplexityResult:
    """Perplexity of a token list; see `perplexity` (bos_id: the BOS that replaces the first token
    of every llama.cpp chunk, None when the tokenizer adds no BOS)."""
    _check_fits(cfg, ctx, f"a perplexity window (ctx={ctx})")
    tokens = check_token_ids(tokens, cfg.vocab_size, "the text")
    windows = llama_cpp_windows(tokens, ctx, bos_id) if stride is None else strided_windows(tokens, ctx, stride)
    nll = window_nll(cfg, params, windows, batch=batch, dtype=dtype, progress=progress, kv_dtype=kv_dtype)
    ppl, std, mean = _ppl_stats(nll)
    return PerplexityResult(ppl, std, mean, len(nll), len(tokens), len(windows), ctx, stride, nll)


def perplexity(model, text: str, *, ctx: int = 512, stride: int | None = None, batch: int = 4,
               progress: bool = True, dtype=None, kv_dtype: str | None = None) -> PerplexityResult:
    """Perplexity of `text` under the model, with llama.cpp's numbers by default.

    The text is tokenized once, with BOS in front when the model's tokenizer adds one.

    Default (stride None), as llama.cpp's `llama-perplexity -c ctx`: the tokens are cut into
    len // ctx chunks of ctx tokens, each evaluated on its own from position 0; when the tokenizer
    adds BOS, each chunk's first token is replaced by BOS; only the second half of each chunk is
    scored (the logits at positions ctx//2 .. ctx-2, each against the next token: ctx - ctx//2 - 1
    tokens per chunk). Tokens after the last whole chunk are not used. llama.cpp refuses texts
    shorter than 2·ctx tokens; here one chunk (ctx tokens) is enough, and wherever llama.cpp gives
    a number this gives the same one.

    With `stride`: Hugging Face's strided sliding window (`strided_windows`): with stride < ctx
    every token but the first is scored once, with at least ctx - stride tokens of context;
    stride = ctx gives disjoint windows (each window's first token unscored).

    `ppl` is exp(mean nll); `ppl_std` its uncertainty as llama.cpp prints it after "+/-":
    ppl · sqrt(var(nll) / (n - 1)). The progress bar shows the running estimate.

    kv_dtype: the KV cache's storage, "bf16" (default: unquantized), "int8" or "fp8".
    """
    tok = model.tokenizer
    ids = tok.encode(check_text(text, "text"))
    bos = tok.bos_id if (tok.add_bos and tok.bos_id is not None) else None
    return perplexity_of_ids(model.config, model.params, ids, ctx=ctx, stride=stride, bos_id=bos,
                             batch=batch, dtype=dtype, progress=progress, kv_dtype=kv_dtype)


# --- command line -------------------------------------------------------------------------------


def cmd_perplexity(a) -> int:
    path = Path(a.file)
    if not path.is_file():
        raise FileNotFoundError(f"perplexity: text file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    model = load(a.model, progress=not a.json)
    r = perplexity(model, text, ctx=a.ctx, stride=a.stride, batch=a.batch, progress=not a.json,
                   kv_dtype=a.kv_dtype)
    if a.json:
        print(json.dumps(r.to_json()))
        return 0
    mode = f"strided windows, stride {r.stride}" if r.stride else "llama.cpp chunks"
    print(f"{path.name}: {r.n_tokens} tokens, {r.n_windows} windows of {r.n_ctx} ({mode}), {r.n_scored} scored",
          file=sys.stderr)
    print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_std:.5f}")
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "perplexity", help="perplexity of a text file (llama.cpp's chunks, or a strided sliding window)",
        description="Perplexity of a text file. By default as llama.cpp's llama-perplexity computes it: "
                    "non-overlapping chunks of --ctx tokens, the second half of each chunk scored. With "
                    "--stride: Hugging Face's strided sliding window, every token scored once.")
    add_model_argument(p)
    p.add_argument("file", help="UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk / window (default 512)")
    p.add_argument("--stride", type=int, default=None,
                   help="strided sliding window with this stride (default: llama.cpp's chunks)")
    p.add_argument("--batch", type=int, default=4, help="windows evaluated per forward pass (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--kv-dtype", choices=("bf16", "int8", "fp8"), default="bf16",
                   help="KV cache: bf16 (unquantized, in the activation dtype), int8 or fp8 (default bf16)")
    p.set_defaults(func=cmd_perplexity)

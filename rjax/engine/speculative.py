"""Speculative decoding over a slot batch (`rjax.engine.slots.SlotBatch`; one sequence is a batch of
one): draft K tokens cheaply, verify them with one forward pass of K + 1 positions over the
cache, keep the longest prefix the target agrees with plus one token of the target's own, and
roll the cache back by resetting its length.

The rollback is only a length: positions past a slot's length are never read (attention sees
positions up to each query's own), and the next write overwrites them. Acceptance runs on the
device in the same program as the verification: greedy keeps a draft token while it is the
target's argmax; sampling accepts a drafted token x with probability min(1, p(x) / q(x)) (q:
the drafter's distribution; a prompt-lookup draft is certain, q(x) = 1) and on a rejection
draws from max(0, p - q) renormalized, which leaves every emitted token distributed exactly as
plain sampling from p (top-k, top-p and temperature included).

Drafters, static under jit (frozen, hashable):
- `NgramDrafter`: prompt lookup. The sequence's last n-gram is looked up earlier in the
  sequence, on the device, over a token history the loop carries; no second model.
- `ModelDrafter`: a second model with the target's vocabulary (any rjax model, e.g. the target
  itself requantized to fewer bits). Its params and its own KV cache travel beside the
  target's; it drafts K tokens one decode step at a time inside the program, and its cache is
  rolled back with the target's: to the same length, less the one position it never wrote when
  every draft was accepted (that token is fed first in the next round).

`speculative_dispatch` runs many draft-verify-accept rounds as one XLA program, as
`rjax.engine.slots.decode_dispatch` runs many decode steps; K is static, so each K is its own program.
The server calls it over all its slots, `speculative_ids` (rjax.generate, rjax chat) over a
batch of one row.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine import steps
from rjax.engine.slots import init_slots, prefill_into_slots, put_rows, request_arrays, take_rows
from rjax.loading.programs import device_program
from rjax.math.cache import KVCache, init_cache
from rjax.math.config import ModelConfig
from rjax.math.model import forward
from rjax.math.paged_cache import put_row_view, row_view
from rjax.math.params import Params
from rjax.math.sampling import SamplingParams, filtered_logits


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""
    max_ngram: int = 3
    min_ngram: int = 1

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """The host version (the reference the device lookup is tested against)."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    def lookup(self, hist, length, k: int):
        """On the device: hist [S] (the first `length` real), -> (drafts [k] int32, how many
        are real), as `draft(hist[:length], k)`."""
        S = hist.shape[0]
        s = jnp.arange(S)
        ext = jnp.concatenate([hist, jnp.zeros(max(k, self.max_ngram), hist.dtype)])
        found, start = jnp.bool_(False), jnp.int32(0)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest first
            tail = jax.lax.dynamic_slice(ext, (length - n,), (n,))
            match = (s <= length - n - 1) & (n <= length - 1)
            for i in range(n):
                match &= ext[i:i + S] == tail[i]
            latest = jnp.max(jnp.where(match, s, -1)).astype(jnp.int32)
            take = ~found & (latest >= 0)
            start = jnp.where(take, latest + n, start)
            found |= take
        drafts = jax.lax.dynamic_slice(ext, (start,), (k,))
        n_real = jnp.where(found, jnp.clip(length - start, 0, k), 0).astype(jnp.int32)
        return drafts.astype(jnp.int32), n_real


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A draft model: its static config here; its params and KV cache are arguments of the loop."""
    cfg: ModelConfig


def check_draft_model(target_cfg: ModelConfig, target_tok, draft_cfg: ModelConfig, draft_tok, name: str) -> None:
    """A draft model must speak the target's vocabulary: same embedding rows, same tokens."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"speculative: the draft model {name} has a vocabulary of {draft_cfg.vocab_size:,} tokens, "
                         f"the target {target_cfg.vocab_size:,}; a draft model needs the target's tokenizer")
    if target_tok is not None and draft_tok is not None and \
            target_tok.backend.get_vocab(with_added_tokens=True) != draft_tok.backend.get_vocab(with_added_tokens=True):
        raise ValueError(f"speculative: the draft model {name} has another tokenizer than the target (same size, "
                         f"different tokens); a draft model needs the target's tokenizer")


def accept(logits, drafts, n_drafts, key, sp: SamplingParams, draft_logq=None, greedy: bool = False):
    """The verification's decision. logits [K + 1, V]: the target's at the last accepted token
    and at each draft; drafts [K] (the first n_drafts real); draft_logq [K, V]: the drafter's
    log-probabilities of each draft's position (None: certain drafts, q(draft) = 1).
    greedy: the caller knows the temperature is 0, so the program holds the greedy rule alone
    (a conditional on the temperature keeps XLA's loop around it on the host).
    -> (m, next): the first m drafts are kept, then `next`, the target's own token (a
    correction, or a bonus after all of them)."""
    K = drafts.shape[0]
    real = jnp.arange(K) < n_drafts

    def leading(ok):
        return jnp.argmin(jnp.concatenate([ok & real, jnp.zeros((1,), bool)])).astype(jnp.int32)

    def greedy_rule():
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        m = leading(drafts == best[:K])
        return m, best[m]

    def sampled():
        rows = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (K + 1,)), sp)  # one setting for every position
        logp = jax.nn.log_softmax(filtered_logits(logits, rows), axis=-1)
        k_accept, k_next = jax.random.split(key)
        ratio = jnp.take_along_axis(logp[:K], drafts[:, None], axis=-1)[:, 0]
        if draft_logq is not None:
            ratio -= jnp.take_along_axis(draft_logq, drafts[:, None], axis=-1)[:, 0]
        m = leading(jnp.log(jax.random.uniform(k_accept, (K,))) < ratio)
        p = jnp.exp(logp[m])
        # On a rejection at m the draft's distribution there is taken out of the target's.
        rejected = m < n_drafts
        at = jnp.minimum(m, K - 1)
        q = jax.nn.one_hot(drafts[at], p.shape[0]) if draft_logq is None else jnp.exp(draft_logq[at])
        residual = jnp.maximum(p - jnp.where(rejected, q, 0), 0)
        row = jnp.where(jnp.any(residual > 0), jnp.log(residual), logp[m])  # p == q: nothing to take out
        return m, jax.random.categorical(k_next, row).astype(jnp.int32)

    return greedy_rule() if greedy else jax.lax.cond(sp.temperature[0] > 0, sampled, greedy_rule)


@dataclasses.dataclass
class SpeculativeStats:
    steps: int = 0      # verification passes
    drafted: int = 0    # draft tokens proposed
    accepted: int = 0   # of those, kept
    k_used: list[int] = dataclasses.field(default_factory=list)  # K of each dispatch
    # Seconds the launches spent compiling a loop program (each K's first launch), which the
    # decode rate leaves out as rjax.generate's plain decoding does (its programs compiled ahead).
    compile_s: float = 0.0
    # At the end: the caches, holding the prompt and every token generated but the last (the
    # draft cache one fewer when the last round accepted every draft).
    cache: KVCache | None = None
    draft_cache: KVCache | None = None


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits when each of k drafts is accepted with probability alpha, independently
    (the accepted prefix plus the target's own token)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def choose_k(alpha: float, candidates: tuple[int, ...], cost_ratio: float) -> int:
    """The K of `candidates` that emits the most tokens per unit of time when a draft step costs
    `cost_ratio` of a verification (at batch 1 both are memory bound, so about the ratio of the
    models' weight bytes; prompt lookup costs nothing). Ties go to the smaller K."""
    return max(sorted(candidates), key=lambda k: expected_tokens(alpha, k) / (1 + k * cost_ratio) - 1e-9 * k)


def speculative_ids(cfg: ModelConfig, params: Params, cache: KVCache, prompt: list[int], *, max_new_tokens: int,
                    stop_ids=(), sp: SamplingParams, seed: int = 0, drafter=NgramDrafter(), draft_params=None,
                    draft_cache: KVCache | None = None, draft_tokens: int | tuple[int, ...] = 4,
                    rounds_per_dispatch: int = 8, stats: SpeculativeStats | None = None,
                    held: int = 0) -> Iterator[list[int]]:
    """Generate for one prompt in slot 0 of a one-slot `cache`, K = draft_tokens drafts per
    verification and `rounds_per_dispatch` rounds per program call. A ModelDrafter needs
    `draft_params` and a one-slot `draft_cache` of the target's max_len. Yields lists of new
    tokens (the first token alone, then each dispatch's), stopping after a stop id, after
    max_new_tokens, or when the cache is full. Greedy output equals plain greedy decoding's.

    held: both caches already hold prompt[:held] (a conversation's earlier turns), so only the
    rest is prefilled; prompt lookup still searches the whole prompt. The final caches are
    left in `stats`.

    draft_tokens as a tuple of candidates: each dispatch takes the K `choose_k` picks for the
    acceptance rate known when it is launched (a running average over dispatches, starting at
    0.5) and a draft step's cost estimated as the draft model's weight bytes over the target's
    (one program per K used). A dispatch is launched before the previous one is read back when
    that rate picks the previous one's K (always, for one K), else after it."""
    stats = stats if stats is not None else SpeculativeStats()
    model = isinstance(drafter, ModelDrafter)
    if model and (draft_params is None or draft_cache is None):
        raise ValueError("drafter: a ModelDrafter needs draft_params and a draft_cache")
    if draft_cache is not None and draft_cache.max_len != cache.max_len:
        raise ValueError(f"draft_cache has max_len {draft_cache.max_len}, the target's cache {cache.max_len}")
    if not 0 <= held < len(prompt):
        raise ValueError(f"held must leave at least one of the prompt's {len(prompt)} tokens to prefill, got {held}")
    if not model:
        draft_params = draft_cache = None
    S = cache.max_len
    stops = np.asarray(sorted(set(int(s) for s in stop_ids)) or [-1], np.int32)
    tokens, lengths = steps.pad_prompts([prompt[held:]])
    # The server's programs over a slot batch of one row: the request as the server runs it.
    rows, seeds, index, rest = request_arrays(1, seed, [max_new_tokens], stops, cfg.vocab_size)
    tokens, lengths, valid = jax.device_put((tokens, lengths, np.ones(1, bool)))
    batch, call, draft = init_slots(1, len(stops), cfg.vocab_size), None, None
    pending = jax.device_put(np.full(1, -1, np.int32)) if model else None
    try:
        first, _, batch, cache = prefill_into_slots(cfg, params, cache, batch, tokens, lengths, rows, valid, seeds,
                                                    index, sp, *rest)
        if model:
            draft_cache, pending = draft_prefill(drafter.cfg, draft_params, draft_cache, pending, tokens, lengths, rows)
        generated = [int(np.asarray(first)[0])]
        yield list(generated)
        if model:
            draft = (draft_cache, pending)
        else:
            hist = np.zeros((1, S + 1), np.int32)
            hist[0, : len(prompt) + 1] = prompt + generated
            draft = jax.device_put((hist, np.asarray([len(prompt) + 1], np.int32)))
        candidates = tuple(draft_tokens) if isinstance(draft_tokens, (tuple, list)) else (draft_tokens,)
        cost_ratio = 0.0 if draft_params is None else _nbytes(draft_params) / max(_nbytes(params), 1)
        alpha = 0.5
        greedy = not np.any(np.asarray(sp.temperature) > 0)

        def ended():  # the sequence's end, as the rounds decide it (the slot state is donated ahead)
            return (generated[-1] in stops or len(generated) >= max_new_tokens
                    or len(prompt) + len(generated) - 1 >= S)

        def launch(k, cache, batch, draft):
            programs, t = speculative_dispatch.compiled_count(), time.perf_counter()
            call = speculative_dispatch(cfg, params, cache, batch, drafter, draft_params, draft, k,
                                        rounds_per_dispatch, None, greedy)
            if speculative_dispatch.compiled_count() > programs:  # compiled before it dispatched
                stats.compile_s += time.perf_counter() - t
            return k, call

        call = None if ended() else launch(choose_k(alpha, candidates, cost_ratio), cache, batch, draft)
        while call is not None:
            k, (out, drafted, accepted, batch, cache, draft) = call
            # The next call is launched before this one is read back when its K is already known:
            # a launch is costly for the host (XLA updates the loop's CUDA graph), and then it
            # overlaps this call's rounds on the device. After the sequence has ended it runs no round.
            k_next = choose_k(alpha, candidates, cost_ratio)
            call = launch(k, cache, batch, draft) if k_next == k else None
            # One read back of everything the host needs: a sync per value costs one round trip each.
            out, drafted, accepted = jax.device_get((out, drafted, accepted))
            rounds = out.reshape(-1, k + 1)
            stats.steps += int((rounds[:, 0] >= 0).sum())  # a round that ran emitted a token
            stats.drafted += int(drafted[0])
            stats.accepted += int(accepted[0])
            stats.k_used.append(k)
            if drafted[0]:
                alpha = 0.5 * alpha + 0.5 * int(accepted[0]) / int(drafted[0])
            new = [int(t) for t in out.reshape(-1) if t >= 0]
            generated += new
            yield new
            if call is not None:  # the caches are the launched call's (it adds nothing once done)
                _, (_, _, _, batch, cache, draft) = call
                if ended():
                    call = None
            elif not ended():
                call = launch(choose_k(alpha, candidates, cost_ratio), cache, batch, draft)
    finally:  # stopped early or not, nothing is left running on the device (steps.settle)
        steps.settle(call, cache, draft)
    stats.cache, stats.draft_cache = cache, draft[0] if model else None


def _nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def draft_cache_for(drafter: ModelDrafter, max_len: int, dtype) -> KVCache:
    if max_len > drafter.cfg.context_length:
        raise ValueError(f"speculative: the draft model's context of {drafter.cfg.context_length} tokens is shorter "
                         f"than the {max_len} positions this generation needs")
    return init_cache(drafter.cfg, 1, max_len, dtype)


# A drafter's per-slot state (`draft` below) travels beside the slots: for NgramDrafter the
# token histories (hist [R, max_len + 1], n_hist [R]: each row's prompt and generated tokens,
# its cache length + 1), made on the host (the server: for each dispatch); for ModelDrafter the draft
# model's own cache (contiguous, or paged over its own pool with the target's block tables) and
# pending [n_slots] (the token at a slot's position length - 1 that the draft cache lacks, or -1),
# both kept by the caller between dispatches.


def _propose(logits, keys, sp: SamplingParams, greedy_only: bool):
    """The draft model's token at one position of every row: logits [B, V], keys [B], sp [B] ->
    (tokens [B], log q [B, V] of the filtered distribution drawn from; zeros for greedy rows). greedy_only (every row is known greedy): the argmax alone;
    else the sampling filters run for every row, with no conditional."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy, jnp.zeros_like(logits)

    def sampled():
        f = filtered_logits(logits, sp)
        drawn = jax.vmap(jax.random.categorical)(keys, f).astype(jnp.int32)
        hot = sp.temperature > 0
        return jnp.where(hot, drawn, greedy), jnp.where(hot[:, None], jax.nn.log_softmax(f, axis=-1), 0.0)

    return sampled()


def _draft_with_model(dcfg: ModelConfig, dparams, dcache, last, pending, held, n, k: int, keys, sp: SamplingParams,
                greedy: bool):
    """Drafts from the draft model for every row at once, one draft decode step for all rows at a time:
    row b drafts n[b] (<= k) tokens after last[b]; its draft cache holds [0, held[b]) but the
    pending token (pending[b] >= 0, at position held[b] - 1; -1 where the row writes nothing).
    -> (drafts [B, k], log q [B, k, V], cache holding [0, held + n) of every drafting row)."""
    B, V = last.shape[0], dcfg.vocab_size
    keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)   # [B, k]
    has, go = pending >= 0, n > 0
    pos = jnp.where(go, held, -1)

    def with_pending():
        # Rows with a pending token feed it beside `last` (two positions); the others feed
        # `last` first and a skipped position after it.
        tokens = jnp.where(has[:, None], jnp.stack([pending, last], 1), jnp.stack([last, jnp.zeros_like(last)], 1))
        p = jnp.where(has[:, None], jnp.stack([held - 1, pos], 1), jnp.stack([pos, jnp.full_like(pos, -1)], 1))
        logits, c = forward(dcfg, dparams, dcache, tokens, p, None, dcache.dtype)
        return logits[jnp.arange(B), has.astype(jnp.int32)], c

    def alone():  # the usual case (each row's last round rejected a draft): one position per row
        logits, c = forward(dcfg, dparams, dcache, last[:, None], pos[:, None], None, dcache.dtype)
        return logits[:, 0], c

    logits0, dcache = jax.lax.cond(jnp.any(has), with_pending, alone)
    d0, q0 = _propose(logits0, keys[:, 0], sp, greedy)
    drafts = jnp.zeros((B, k), jnp.int32).at[:, 0].set(d0)
    logq = jnp.zeros((B, k, V), jnp.float32).at[:, 0].set(q0)

    def body(carry):
        j, drafts, logq, dcache = carry
        p = jnp.where(j < n, held + j, -1)
        logits, dcache = forward(dcfg, dparams, dcache, drafts[:, j - 1][:, None], p[:, None], None, dcache.dtype)
        d, q = _propose(logits[:, 0], keys[:, j], sp, greedy)
        return j + 1, drafts.at[:, j].set(d), logq.at[:, j].set(q), dcache

    _, drafts, logq, dcache = jax.lax.while_loop(lambda c: c[0] < jnp.max(n), body,
                                                 (jnp.int32(1), drafts, logq, dcache))
    return drafts, logq, dcache


def _slots_round(cfg, params, cache, state, sampling: SamplingParams, stop_ids, drafter, draft_params, draft, k: int,
                 greedy: bool):
    """One round for every slot of `cache` at once: each active slot drafts (by prompt lookup in
    its own history, or with the draft model, all rows together), all drafts are verified in one
    forward pass of [n_slots, k + 1] positions, each slot accepts by its own sampling settings and
    random stream (with the draft model's log q), and each slot's length is set to what it
    accepted. -> (emitted [n_slots, k + 1] (-1 padded), drafted [n_slots], accepted [n_slots],
    state, cache, draft)."""
    S = cache.max_len
    held = cache.lengths
    active = ~state.done & (held < S)
    room = jnp.where(active, jnp.clip(jnp.minimum(S - held - 1, state.remaining - 1), 0, k), 0)
    if isinstance(drafter, ModelDrafter):
        dcache, pending = draft
        split = jax.vmap(lambda key: jax.random.split(key, 3))(state.key)
        keys, k_draft, subs = split[:, 0], split[:, 1], split[:, 2]
        drafts, logq, dcache = _draft_with_model(drafter.cfg, draft_params, dcache, state.last_token,
                                           jnp.where(active, pending, -1), held, room, k, k_draft, sampling, greedy)
        n = room
    else:
        hist, n_hist = draft
        pair = jax.vmap(jax.random.split)(state.key)
        keys, subs = pair[:, 0], pair[:, 1]
        drafts, found = jax.vmap(lambda h, c: drafter.lookup(h, c, k))(hist, n_hist)
        logq, n = None, jnp.minimum(found, room)
    t = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    tokens = jnp.concatenate([state.last_token[:, None], drafts], axis=1)
    pos = jnp.where(active[:, None] & (t <= n[:, None]), held[:, None] + t, -1)
    logits, cache = forward(cfg, params, cache, tokens, pos, None, cache.dtype)

    def one(lg, d, nd, key, temperature, top_k, top_p, lq):
        return accept(lg, d, nd, key, SamplingParams(temperature[None], top_k[None], top_p[None]), lq, greedy)

    m, nxt = jax.vmap(one)(logits, drafts, n, subs, sampling.temperature, sampling.top_k, sampling.top_p, logq)
    ext = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    emitted = jnp.where(t < m[:, None], ext, nxt[:, None])
    stop = steps.is_stop(emitted, stop_ids) & (t <= m[:, None])
    e = jnp.minimum(jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, m + 1), state.remaining)
    e = jnp.where(active, e, 0)
    out = jnp.where(t < e[:, None], emitted, -1)
    # The cache keeps what was fed for the emitted tokens: all of them but the last. That is
    # held + 1 + m unless a stop id or the budget cut the round short (and the sequence ends).
    new_held = held + e
    cache = dataclasses.replace(cache, lengths=new_held)
    if isinstance(drafter, ModelDrafter):
        # All drafts kept: the last one is in the target's cache but was never fed to the draft model.
        last_fed = jnp.take_along_axis(tokens, m[:, None], axis=1)[:, 0]
        pending = jnp.where(active, jnp.where(m == n, last_fed, -1), pending)
        dcache = dataclasses.replace(dcache, lengths=jnp.where(active, new_held - (pending >= 0), dcache.lengths))
        draft = (dcache, pending)
    else:
        cols = jnp.where(active[:, None] & (t <= m[:, None]), n_hist[:, None] + t, hist.shape[1])
        hist = hist.at[jnp.arange(hist.shape[0])[:, None], cols].set(emitted, mode="drop")
        draft = (hist, jnp.where(active, n_hist + 1 + m, n_hist))
    remaining = state.remaining - e
    done = state.done | (active & steps.finished(jnp.any(stop & (t < e[:, None]), axis=1), remaining, new_held, S))
    state = dataclasses.replace(state, last_token=jnp.where(active, nxt, state.last_token), done=done,
                                remaining=remaining, key=jnp.where(active, keys, state.key))
    return out, jnp.where(active, n, 0), jnp.where(active, m, 0), state, cache, draft


@device_program(static_argnames=("cfg", "drafter", "k", "n_rounds", "greedy"),
                   donate_argnames=("cache", "slots", "draft"), compiler_options=steps.DECODE_LOOP_COMPILER_OPTIONS)
def speculative_dispatch(cfg: ModelConfig, params: Params, cache, slots, drafter, draft_params, draft, k: int,
                         n_rounds: int, rows=None, greedy: bool = False):
    """Up to n_rounds speculative rounds over the slots of a serving engine (`rjax.engine.slots.SlotBatch`
    and its contiguous or paged cache) in one XLA program, stopping early when every slot is
    done; the counterpart of `rjax.engine.slots.decode_dispatch`. rows: None for every slot, or (paged
    cache) the slots to run [R], padded with n_slots, as decode_dispatch takes them.
    drafter: NgramDrafter, with draft = (hist [R, max_len + 1], n_hist [R]) and draft_params
    None; or ModelDrafter, with its draft_params and draft = (its cache over all n_slots, pending
    [n_slots]) (see above). A paged slot must own pages for every position it may write: up to
    n_rounds * (k + 1) past its length, within its token budget.
    greedy (static: a second program): every slot that runs decodes at temperature 0, so drafts
    and acceptance take the argmax rule alone (under vmap, acceptance's per-row conditional
    would otherwise compute the sampled rule, with its filters over the vocabulary, for every row).
    -> (tokens [n_slots, n_rounds * (k + 1)] int32, -1 padded; drafted [n_slots]; accepted
    [n_slots]; slots; cache; draft, advanced)."""
    if rows is None:
        return _dispatch_rows(cfg, params, cache, slots, drafter, draft_params, draft, k, n_rounds, greedy)
    sub, view = take_rows(slots, cache, rows)
    model = isinstance(drafter, ModelDrafter)
    if model:
        dcache, pending = draft
        n = pending.shape[0]
        draft = (row_view(dcache, rows), jnp.where(rows < n, pending[jnp.minimum(rows, n - 1)], -1))
    out, drafted, accepted, sub, view, sub_draft = _dispatch_rows(cfg, params, view, sub, drafter, draft_params,
                                                                  draft, k, n_rounds, greedy)
    n = slots.state.last_token.shape[0]

    def scatter(x):
        return jnp.zeros((n,) + x.shape[1:], x.dtype).at[rows].set(x, mode="drop")

    out = jnp.full((n, out.shape[1]), -1, jnp.int32).at[rows].set(out, mode="drop")
    cache = put_row_view(cache, rows, view)
    slots = dataclasses.replace(slots, state=put_rows(slots.state, rows, sub.state))
    if model:
        sub_draft = (put_row_view(dcache, rows, sub_draft[0]), pending.at[rows].set(sub_draft[1], mode="drop"))
    return out, scatter(drafted), scatter(accepted), slots, cache, sub_draft


def _dispatch_rows(cfg, params, cache, slots, drafter, draft_params, draft, k: int, n_rounds: int, greedy: bool):
    B = slots.state.last_token.shape[0]
    out0 = jnp.full((B, n_rounds, k + 1), -1, jnp.int32)
    z = jnp.zeros(B, jnp.int32)

    def body(carry):
        i, out, drafted, accepted, state, cache, draft = carry
        row, n, m, state, cache, draft = _slots_round(cfg, params, cache, state, slots.sampling, slots.stop_ids,
                                                      drafter, draft_params, draft, k, greedy)
        return i + 1, out.at[:, i].set(row), drafted + n, accepted + m, state, cache, draft

    carry = (jnp.int32(0), out0, z, z, slots.state, cache, draft)
    _, out, drafted, accepted, state, cache, draft = jax.lax.while_loop(
        lambda c: (c[0] < n_rounds) & ~jnp.all(c[4].done), body, carry)
    return out.reshape(B, -1), drafted, accepted, dataclasses.replace(slots, state=state), cache, draft


@device_program(static_argnames=("cfg",), donate_argnames=("cache", "pending"))
def draft_prefill(cfg: ModelConfig, params: Params, cache, pending, tokens, lengths, rows):
    """Write tokens [P, T] (lengths [P]; 0: padding) into the draft model's cache rows `rows` [P]
    after what they hold: the chunks the target prefills, or the positions a slot decoded
    without drafting. Those slots then have no pending token. -> (cache, pending)."""
    _, cache = steps._prefill_logits(cfg, params, cache, tokens, lengths, rows)   # the logits go unused: cut by XLA
    return cache, pending.at[rows].set(-1, mode="drop")

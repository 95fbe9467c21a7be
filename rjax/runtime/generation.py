"""Host-side text generation over the jitted engine: prompts in, streamed text out.

Everything that runs per token stays on the device, in the server's slot programs (`rjax.engine.slots`)
over one row per prompt; the host only turns token ids into text and measures time.

Every limit is checked on the host before anything is allocated or dispatched (`check_text`,
`check_request`): text that is not valid UTF-8, an empty prompt, token ids outside the
vocabulary, a prompt plus `max_new_tokens` beyond the model's context (PromptTooLongError,
ContextLengthError), sampling settings out of range. A refused call raises ValueError (or a
subclass) and changes nothing, a given cache included.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine import steps as engine, slots
from rjax.engine.precompile import compile_programs, decode_dispatch_program, prefill_into_slots_program
from rjax.engine.speculative import (ModelDrafter, NgramDrafter, SpeculativeStats, check_draft_model, draft_cache_for,
                                     speculative_ids)
from rjax.engine.steps import ContextLengthError, PromptTooLongError  # noqa: F401 (part of this module's API)
from rjax.loading.loaders import Model, load
from rjax.math.cache import KVCache, check_kv_dtype, init_cache
from rjax.math.config import ModelConfig
from rjax.math.plan import decode_positions
from rjax.math.sampling import SamplingParams, check_sampling
from rjax.math.tensor_parallel import place_cache
from rjax.runtime import request
from rjax.runtime.serving import ServingConfig, ServingEngine
from rjax.runtime.serving_limits import MAX_DRAFT_TOKENS


class InvalidTextError(ValueError):
    """Text that cannot be UTF-8: undecodable bytes, or a str with an unpaired surrogate."""


@dataclasses.dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (end-of-sequence token), "length" (token limit) or "context" (cache full)
    ttft_s: float
    decode_tokens_per_s: float
    # With speculative decoding: verification steps, draft tokens proposed and accepted.
    speculative: dict | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def activation_dtype():
    """float32 on CPU (matches the float32 oracle), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def cache_length(needed: int, context_length: int) -> int:
    """Cache sizes come from the bucket list too, so nearby requests share compiled programs."""
    for b in engine.PROMPT_BUCKETS:
        if b >= max(needed, 256):
            return min(b, context_length)
    return context_length


def check_text(text, what: str = "prompt") -> str:
    """`text` as a str that UTF-8 can encode: bytes are decoded as UTF-8 (strictly), and a str
    must not hold unpaired surrogates (what `errors="surrogateescape"` makes of bad bytes),
    which the tokenizer cannot take. Raises InvalidTextError naming the offset, or TypeError."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidTextError(f"{what} is not valid UTF-8: byte {bytes(text)[e.start]:#04x} at offset {e.start} "
                                   f"({e.reason}); decode it yourself, e.g. with errors='replace'") from None
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str (or UTF-8 bytes), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidTextError(f"{what} has an unpaired surrogate U+{ord(text[e.start]):04X} at index {e.start}, "
                               f"which UTF-8 cannot encode") from None
    return text


def encode_prompt(model: Model, prompt: str, raw: bool = False) -> list[int]:
    """Chat-template the prompt as one user turn (unless raw), then tokenize. A model file
    without a chat template (a base model) gets its prompt as raw text, with a warning."""
    prompt = check_text(prompt)
    if not raw and model.tokenizer.chat_template is None:
        warnings.warn(f"{model.name} has no chat template (a base model): the prompt is completed as raw text "
                      f"(raw=True says so and silences this)", stacklevel=3)
        raw = True
    if raw:
        return model.tokenizer.encode(prompt)
    return model.tokenizer.encode_chat([{"role": "user", "content": prompt}])


def check_prompt_lengths(model: Model, prompts: Sequence[Sequence[int]]) -> None:
    ctx = model.config.context_length
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: at least one token is needed")
        if len(p) >= ctx:
            raise PromptTooLongError(f"prompt {i} has {len(p)} tokens; the context of {model.name} "
                                     f"is {ctx} tokens and generation needs at least one free position")


def check_token_ids(model: Model, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each prompt as a list of ints in [0, vocab_size), else ValueError naming the first bad id."""
    return [request.check_token_ids(p, model.config.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]


def check_request(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens, temperature, top_k, top_p,
                  seed, steps_per_dispatch, cache: KVCache | None = None) -> list[list[int]]:
    """Every limit of a generation request, checked on the host before anything is allocated or
    dispatched. -> the prompts as lists of ints.

    Without a cache, each prompt and its `max_new_tokens` must fit the model's context (as the
    OpenAI API asks); with one (a conversation's next turn), each prompt must leave a free
    position after what its slot holds, and generation stops at the end of the cache
    (finish reason "context")."""
    request.check_max_new_tokens(max_new_tokens)
    if not request.is_int(steps_per_dispatch) or steps_per_dispatch < 1:
        raise ValueError(f"steps_per_dispatch must be an integer >= 1, got {steps_per_dispatch!r}")
    if not request.is_int(seed) or not -2**63 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    check_sampling(temperature, top_k, top_p)
    if not len(prompts):
        raise ValueError("no prompts: at least one is needed")
    prompts = check_token_ids(model, prompts)
    check_prompt_lengths(model, prompts)
    ctx = model.config.context_length
    if cache is None:
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > ctx:
                raise ContextLengthError(
                    f"prompt {i} has {len(p)} tokens and max_new_tokens is {max_new_tokens}: {len(p) + max_new_tokens} "
                    f"positions, beyond the context of {ctx} tokens (max_new_tokens can be at most {ctx - len(p)})")
    else:
        if cache.n_slots != len(prompts):
            raise ValueError(f"the cache has {cache.n_slots} slots for {len(prompts)} prompts: one prompt per slot")
        held = np.asarray(cache.lengths)
        for i, p in enumerate(prompts):
            if held[i] + len(p) >= cache.max_len:
                raise PromptTooLongError(f"prompt {i} of {len(p)} tokens after the {int(held[i])} positions its slot "
                                         f"holds leaves no room to generate in a cache of {cache.max_len} positions")
    return prompts


# Decode steps (or speculative rounds) per program call; a stream yields once per call. A call
# costs the host its launch and reading the tokens back. A loop that runs on the device
# (`slots.decode_dispatch`) returns at once, so the next call's launch overlaps this one's
# steps; a loop that stays on the host still pays that cost per call
# (docs/architecture.md, "Engine").
STEPS_PER_DISPATCH = 32


def stream_ids(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               steps_per_dispatch: int = STEPS_PER_DISPATCH, stats: dict | None = None,
               cache: KVCache | None = None, kv_dtype: str | None = None,
               progress: bool = False, prefill_chunk: int | None = None) -> Iterator[list[list[int]]]:
    """Generate for several tokenized prompts at once (one cache slot each), yielding the new
    token ids of every prompt after each device dispatch.

    `cache` (optional, one slot per prompt): continue sequences it already holds, the prompts
    being appended after each slot's length (a conversation's new turn over its cached prefix).
    `kv_dtype`: how a fresh cache stores K/V, "bf16" (default: unquantized, in the activation
    dtype), "int8" or "fp8" (rjax.math.cache.init_cache).
    `stats` (optional) receives timings (`compile_s`: lowering and compiling the prefill and
    decode programs, concurrently, before the first call; `ttft_s` then runs from the prefill
    call to the first token on the host), each prompt's finish reason and the final `cache`,
    which holds every prompt and generated token but the last one generated.
    `progress`: a "compiling" bar on stderr while programs not yet compiled in this process are
    built (or read from the persistent compile cache).
    `prefill_chunk` (one prompt only; a length of engine.PROMPT_BUCKETS): the prompt is
    prefilled in pieces of this many tokens, each padded to it, so prompts of any length call
    one prefill program (a conversation's turns, each of a new length, compile nothing new).

    The request is checked (`check_request`) when this is called, before the first step."""
    prompts = check_request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, steps_per_dispatch=steps_per_dispatch, cache=cache)
    check_kv_dtype(kv_dtype)
    if prefill_chunk is not None and (prefill_chunk not in engine.PROMPT_BUCKETS or len(prompts) != 1):
        raise ValueError(f"prefill_chunk must be one of engine.PROMPT_BUCKETS, for one prompt; got {prefill_chunk!r} "
                         f"for {len(prompts)} prompts")
    return _stream_ids(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, steps_per_dispatch, stats,
                       cache, kv_dtype, progress, prefill_chunk)


def _stream_ids(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, steps_per_dispatch, stats, cache,
                kv_dtype=None, progress=False, prefill_chunk=None):
    cfg, tok = model.config, model.tokenizer
    B = len(prompts)
    if prefill_chunk is None:
        pieces = [engine.pad_prompts(prompts)]
    else:
        [p] = prompts
        pieces = [engine.pad_prompts([p[i:i + prefill_chunk]], prefill_chunk) for i in range(0, len(p), prefill_chunk)]
    lengths = sum(n for _, n in pieces)
    if cache is None:
        cache = place_cache(init_cache(cfg, B, cache_length(int(lengths.max()) + max_new_tokens, cfg.context_length),
                                       activation_dtype(), kv_dtype), model.params.tp)
    S = cache.max_len
    end = np.asarray(cache.lengths) + lengths  # each slot's length after the prompt
    stop_ids = np.asarray(sorted(tok.eos_ids) or [-1], np.int32)
    # Prompt i runs as the server runs a request of seed `seed` and sample index i.
    budget = np.minimum(max_new_tokens, S - end).astype(np.int32)
    rows, seeds, index, rest = slots.request_arrays(B, seed, budget, stop_ids, cfg.vocab_size)
    sp = SamplingParams(*jax.device_put((np.full(B, temperature, np.float32), np.full(B, top_k, np.int32),
                                         np.full(B, top_p, np.float32))))
    batch = slots.init_slots(B, len(stop_ids), cfg.vocab_size)
    greedy = temperature == 0
    filters = bool(top_k > 0 or top_p < 1)
    params = engine.program_params(model.params, activation_dtype())
    # Both programs at once, before the first call (a no-op where they are compiled already).
    compiled = compile_programs([prefill_into_slots_program(cfg, params, cache, batch, B, pieces[0][0].shape[1]),
                                 decode_dispatch_program(cfg, params, cache, batch, steps_per_dispatch,
                                                         greedy=greedy, filters=filters)], progress=progress)

    t0 = time.perf_counter()
    call = None
    try:
        for i, (tokens, n) in enumerate(pieces):  # a piece before the last starts nothing
            valid = np.full(B, i == len(pieces) - 1)
            first, _, batch, cache = slots.prefill_into_slots(cfg, params, cache, batch, *jax.device_put(
                (tokens, n)), rows, jax.device_put(valid), seeds, index, sp, *rest)
        first_host = np.asarray(first)
        ttft = time.perf_counter() - t0
        generated = [[int(t)] for t in first_host]
        yield [[int(t)] for t in first_host]

        # Decode speed: the tokens after the first over the time from the first token on the host to
        # the last (the programs were compiled above, so no dispatch includes a compilation), as
        # speculative decoding measures it.
        # Each dispatch is launched before the one before it is read back (see STEPS_PER_DISPATCH).
        # None is launched past what the token budgets allow; one launched before a stop token was
        # read back runs no step.
        dispatches: list[tuple[float, int]] = []
        t_prev = time.perf_counter()
        steps_left = int(budget.max()) - 1  # decode steps any slot can still take

        def launch(cache, batch):  # called as the server calls it: the same compiled program
            return slots.decode_dispatch(cfg, params, cache, batch, steps_per_dispatch, False, None, greedy,
                                         filters, False)

        # Every row done, by the tokens on the host (the slot state is donated to the call ahead).
        stops = set(stop_ids.tolist())

        def all_done():
            return all(g[-1] in stops or len(g) >= n for g, n in zip(generated, budget))

        call = None if all_done() else launch(cache, batch)
        launched = 1
        while call is not None:
            out, _, batch, cache = call
            call = None
            if launched * steps_per_dispatch < steps_left:
                call = launch(cache, batch)
                cache, launched = call[3], launched + 1  # this cache was donated to the new call
            new = [[int(t) for t in row if t >= 0] for row in jax.device_get(out)]
            now = time.perf_counter()
            dispatches.append((now - t_prev, sum(len(r) for r in new)))
            t_prev = now
            for g, r in zip(generated, new):
                g.extend(r)
            if all_done():
                call = None
            yield new
    finally:
        # Stopped early or not, nothing of this stream is left running on the device; a stream
        # that stopped early leaves its last cache in `stats` (its slots' lengths past what
        # was yielded: a caller rolls back by resetting them, as rjax.runtime.chat does).
        engine.settle(call, cache)
        if stats is not None:
            stats["cache"] = cache if call is None else call[3]
    decode_s = sum(d for d, _ in dispatches)
    if stats is not None:
        eos = set(tok.eos_ids)
        stats.update(compile_s=compiled.total_s, ttft_s=ttft, decode_s=decode_s,
                     first_dispatch_s=dispatches[0][0] if dispatches else 0.0,
                     decode_tokens_per_s=(sum(n for _, n in dispatches) / decode_s) if decode_s > 0 else 0.0,
                     finish_reasons=["stop" if g and g[-1] in eos else
                                     "length" if len(g) >= max_new_tokens else "context" for g in generated])


# draft_tokens="auto": the K of each dispatch chosen from these by the acceptance rate so far
# (rjax.engine.speculative.choose_k); K + 1 <= 16 verified positions stay on the decode attention kernel.
AUTO_DRAFT_TOKENS = (2, 4, 7)
SELF_DRAFT_TYPES = ("q8_0", "q4_0")


def check_draft_tokens(draft_tokens) -> None:
    if draft_tokens not in ("auto", None) and (not request.is_int(draft_tokens)
                                                or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS):
        raise ValueError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], 'auto' or None, "
                         f"got {draft_tokens!r}")


# K for a draft model where none is given: each draft costs one of its decode steps.
MODEL_DRAFT_TOKENS = 4


def default_draft_tokens(cfg: ModelConfig, drafter) -> int:
    """K where none is given. Prompt lookup drafts for free, and a verification costs about the
    same up to the most positions the decode attention kernel takes, so it drafts that many less
    one (15 for up to 4 query heads per KV head of dim 128, else 7), which measured faster than
    K=4 (docs/architecture.md, "Host side"). A draft model: MODEL_DRAFT_TOKENS."""
    if not isinstance(drafter, NgramDrafter):
        return MODEL_DRAFT_TOKENS
    return min(MAX_DRAFT_TOKENS, decode_positions(cfg)) - 1


def load_drafter(model: Model, speculative) -> tuple[object, Model | None]:
    """`speculative` -> (drafter, draft model or None): "ngram" (prompt lookup); "self:q4_0" or
    "self:q8_0" (the target's own weights requantized on load: `rjax.load(..., requantize=)`);
    a catalog name, .gguf file or Hugging Face directory; or a loaded Model. A draft model must
    have the target's tokenizer."""
    if speculative == "ngram":
        return NgramDrafter(), None
    if isinstance(speculative, Model):
        draft = speculative
    elif isinstance(speculative, str) and speculative.startswith("self:"):
        qtype = speculative.split(":", 1)[1].lower()
        if qtype not in SELF_DRAFT_TYPES:
            raise ValueError(f"speculative={speculative!r}: the target can draft for itself requantized to "
                             f"{' or '.join(SELF_DRAFT_TYPES)} (e.g. 'self:q4_0')")
        draft = load(model.source, progress=False, requantize=qtype)
    elif isinstance(speculative, str) and speculative:
        draft = load(speculative, progress=False)
    else:
        raise ValueError(f"speculative must be 'ngram', 'self:q4_0' / 'self:q8_0', a model (catalog name, .gguf "
                         f"file, Hugging Face directory) or a loaded Model, got {speculative!r}")
    check_draft_model(model.config, model.tokenizer, draft.config, draft.tokenizer, draft.name)
    return ModelDrafter(draft.config), draft


def _speculative_generate(model: Model, ids: list[int], drafter, draft: Model | None, draft_tokens: int, *,
                          max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                          seed: int = 0, steps_per_dispatch: int = STEPS_PER_DISPATCH,
                          kv_dtype: str | None = None) -> GenerationResult:
    [ids] = check_request(model, [ids], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, steps_per_dispatch=steps_per_dispatch)
    cfg, tok = model.config, model.tokenizer
    S = cache_length(len(ids) + max_new_tokens, cfg.context_length)
    cache = place_cache(init_cache(cfg, 1, S, activation_dtype(), kv_dtype), model.params.tp)
    draft_cache = draft_cache_for(drafter, S, activation_dtype()) if draft is not None else None
    stats = SpeculativeStats()
    t0 = time.perf_counter()
    steps = speculative_ids(cfg, engine.program_params(model.params, activation_dtype()), cache, ids,
                            max_new_tokens=max_new_tokens, stop_ids=tok.eos_ids,
                            sp=SamplingParams.make(1, temperature, top_k, top_p), seed=seed, drafter=drafter,
                            draft_params=None if draft is None else engine.program_params(draft.params,
                                                                                          activation_dtype()),
                            draft_cache=draft_cache,
                            draft_tokens=draft_tokens, rounds_per_dispatch=steps_per_dispatch, stats=stats)
    generated = list(next(steps))
    ttft = time.perf_counter() - t0
    for new in steps:
        generated += new
    decode_s = time.perf_counter() - t0 - ttft - stats.compile_s  # as plain decoding's: no compile in it
    reason = "stop" if generated[-1] in tok.eos_ids else "length" if len(generated) >= max_new_tokens else "context"
    return GenerationResult(ids, generated, tok.decode(_visible(tok, generated)), reason, ttft,
                            (len(generated) - 1) / decode_s if decode_s > 0 else 0.0,
                            dict(steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                                 drafter="ngram" if draft is None else draft.name, k_used=stats.k_used,
                                 compile_s=stats.compile_s))


def _visible(tok, ids: list[int]) -> list[int]:
    return [t for t in ids if t not in tok.eos_ids]


def stream(model: Model, prompt: str, *, raw: bool = False, stats: dict | None = None, **kw) -> Iterator[str]:
    """Yield the reply to one prompt as text chunks, as they are generated. The prompt and
    settings are checked when this is called (ValueError), before the first chunk."""
    ids = encode_prompt(model, prompt, raw)
    return _stream_text(model, stream_ids(model, [ids], stats=stats, **kw))


def _stream_text(model: Model, steps) -> Iterator[str]:
    dec = model.tokenizer.stream_decoder()
    try:
        for step in steps:
            chunk = "".join(dec.add(t) for t in _visible(model.tokenizer, step[0]))
            if chunk:
                yield chunk
    finally:  # a stream stopped early (Ctrl-C in a notebook, a break) settles its device work now
        steps.close()
    tail = dec.flush()
    if tail:
        yield tail


DEFAULT_SERVING_SLOTS = 32


def serve_ids(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256, temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, seed: int = 0, steps_per_dispatch: int = STEPS_PER_DISPATCH,
              n_slots: int = DEFAULT_SERVING_SLOTS, speculative=None, draft_tokens: int = 4,
              kv_dtype: str | None = None):
    """Tokenized prompts through the continuous-batching engine (`rjax.runtime.serving`) with up to
    `n_slots` running at once; more wait for a free slot. speculative: drafts of `draft_tokens`
    tokens for every slot, verified in one batched pass (ServingConfig.speculative), by any
    drafter `load_drafter` takes: "ngram" (prompt lookup), "self:q4_0" / "self:q8_0", a draft
    model's catalog name or path, or a loaded Model (the draft model gets a cache of its own
    beside the target's: ServingEngine's `draft`). -> list of `serving.Completion`."""
    if not request.is_int(n_slots) or n_slots < 1:
        raise ValueError(f"n_slots must be an integer >= 1, got {n_slots!r}")
    prompts = check_request(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, steps_per_dispatch=steps_per_dispatch)
    draft = None if speculative is None else load_drafter(model, speculative)[1]
    cfg, tok = model.config, model.tokenizer
    S = cache_length(max(len(p) for p in prompts) + max_new_tokens, cfg.context_length)
    stop_ids = sorted(tok.eos_ids)
    config = ServingConfig(n_slots=max(1, min(len(prompts), n_slots)), max_len=S, page_size=16 if S % 16 == 0 else None,
                           steps_per_dispatch=steps_per_dispatch, max_stop_ids=max(8, len(stop_ids)),
                           speculative=None if speculative is None else "ngram" if draft is None else "model",
                           draft_tokens=draft_tokens,
                           # One call's prompts start together: sharing a prefix among them would
                           # hold every prompt after the first back a step and build a second
                           # prefill program for the remainders, more than a shared prompt saves.
                           prefix_cache=False,
                           kv_dtype=jnp.dtype(activation_dtype()).name if check_kv_dtype(kv_dtype) == "bf16"
                           else kv_dtype)
    eng = ServingEngine(cfg, model.params, config, stop_ids=stop_ids, seed=seed,
                        draft=None if draft is None else (draft.config, draft.params))
    ids = [eng.submit(p, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
           for p in prompts]
    done = {e.request_id: e.completion for e in eng.run() if e.finished}
    return [done[i] for i in ids]


def _generate_list(model: Model, prompts, raw: bool, kw: dict) -> list[GenerationResult]:
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompt must be a str (or UTF-8 bytes) or a list of them, got {type(prompts).__name__}")
    tok = model.tokenizer
    ids = [encode_prompt(model, check_text(p, f"prompt {i}"), raw) for i, p in enumerate(prompts)]
    if not ids:
        return []
    drafter = None
    if kw.get("speculative") is not None:
        # A draft model is loaded once, here; serve_ids gets the loaded Model (load_drafter only checks it).
        draft = load_drafter(model, kw["speculative"])[1]
        drafter = "ngram" if draft is None else draft.name
        kw = dict(kw, speculative="ngram" if draft is None else draft)
    return [GenerationResult(c.prompt, c.tokens, tok.decode(_visible(tok, c.tokens)), c.finish_reason, c.ttft_s,
                             c.decode_tokens_per_s,
                             dict(drafted=c.drafted, accepted=c.accepted, drafter=drafter) if drafter else None)
            for c in serve_ids(model, ids, **kw)]


def generate(model: Model, prompt: str | Sequence[str], *, raw: bool = False, speculative=None,
             draft_tokens: int | str | None = None, **kw):
    """Text in, text out. A list of prompts runs through the continuous-batching engine (up to
    `n_slots`, default 32, at once) and returns a list of results in prompt order.

    Keyword arguments: max_new_tokens, temperature, top_k, top_p, seed, steps_per_dispatch,
    kv_dtype ("bf16", "int8", "fp8": how the KV cache stores keys and values; rjax.math.cache) (and
    n_slots for a list). Returns GenerationResult (or a list of them) with token ids, text,
    finish reason and timings (for a list: each request's own time to first token and decode rate).
    speculative: one prompt decoded by drafts of `draft_tokens` tokens, each batch of drafts
    verified in one forward pass (`rjax.engine.speculative`): "ngram" (prompt lookup), "self:q4_0" /
    "self:q8_0" (the target requantized as its own draft model), a draft model with the
    target's tokenizer (catalog name, path, or a loaded Model). The same tokens as without for
    greedy decoding, the same distribution for sampling; the result's `speculative` reports
    steps, drafted and accepted counts. draft_tokens: None for the drafter's default
    (`default_draft_tokens`), or "auto": each dispatch's K chosen from AUTO_DRAFT_TOKENS by the
    acceptance rate so far. A list of prompts takes the same drafters
    (the draft model loaded once, drafting for all slots of the serving engine together over a
    cache of its own) and a fixed `draft_tokens` (not "auto"); each result's `speculative`
    reports its own drafted and accepted counts and the drafter ("ngram" or the draft model's name).
    """
    tok = model.tokenizer
    if speculative is not None:
        check_draft_tokens(draft_tokens)
        auto = draft_tokens == "auto"
        if not isinstance(prompt, (str, bytes, bytearray)):
            if auto:
                raise ValueError("draft_tokens='auto' is for one prompt; a list of prompts runs through the serving "
                                 "engine, which drafts a fixed K for all its slots: give draft_tokens an integer")
            given = {} if draft_tokens is None else dict(draft_tokens=draft_tokens)  # else the engine's default
            return _generate_list(model, prompt, raw, dict(kw, speculative=speculative, **given))
        ids = encode_prompt(model, prompt, raw)
        drafter, draft = load_drafter(model, speculative)
        k = (AUTO_DRAFT_TOKENS if auto else default_draft_tokens(model.config, drafter) if draft_tokens is None
             else draft_tokens)
        return _speculative_generate(model, ids, drafter, draft, k, **kw)
    if not isinstance(prompt, (str, bytes, bytearray)):
        return _generate_list(model, prompt, raw, kw)
    ids = encode_prompt(model, prompt, raw)
    stats: dict = {}
    generated: list[int] = []
    for step in stream_ids(model, [ids], stats=stats, **kw):
        generated.extend(step[0])
    return GenerationResult(ids, generated, tok.decode(_visible(tok, generated)), stats["finish_reasons"][0],
                            stats["ttft_s"], stats["decode_tokens_per_s"])

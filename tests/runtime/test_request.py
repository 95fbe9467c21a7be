"""Limits as clear errors, the cache unchanged: every public entry point refuses what it cannot
run (a prompt past the context, max_new_tokens past it, more prompts than slots, sampling
settings out of range, empty prompts, token ids outside the vocabulary, text that is not UTF-8)
with a ValueError (or a subclass) that names the parameter and the limit, before anything is
dispatched; after each refused call the same cache, session or engine still generates the same
tokens (small synthetic model on the CPU)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rjax
from rjax.engine import steps
from rjax.engine.steps import ContextLengthError, PromptTooLongError
from rjax.math.cache import init_cache
from rjax.math.sampling import SamplingParams, check_sampling
from rjax.runtime import scoring
from rjax.runtime.chat import ChatSession
from rjax.runtime.generation import InvalidTextError, check_text, stream_ids
from rjax.runtime.serving import ServingConfig, ServingEngine

BAD_SAMPLING = [
    (dict(temperature=float("nan")), r"temperature must be >= 0 and finite .*got nan"),
    (dict(temperature=-0.5), r"temperature must be >= 0 .*got -0\.5"),
    (dict(temperature=float("inf")), r"temperature must be >= 0 and finite .*got inf"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] .*got 0\.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] .*got 1\.5"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\] .*got nan"),
    (dict(top_k=-1), r"top_k must be >= 0 .*got -1"),
    (dict(top_k=2.5), r"top_k must be an integer, got 2\.5"),
    (dict(top_k=2**31), r"top_k must be >= 0 and at most 2147483647 .*got 2147483648"),
    (dict(temperature="hot"), r"temperature must be a number, got 'hot'"),
]


@pytest.fixture(scope="module")
def model(tiny_path):
    return rjax.load(tiny_path, progress=False)


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


def _snapshot(cache):
    return [np.asarray(a) for a in jax.tree.leaves(cache)]


def _assert_unchanged(cache, snapshot):
    """Not donated (still readable) and holding what it held."""
    leaves = jax.tree.leaves(cache)
    assert not any(a.is_deleted() for a in leaves), "a refused call gave the cache away"
    for a, b in zip(leaves, snapshot):
        np.testing.assert_array_equal(np.asarray(a), b)


def _greedy(cfg, params, cache, logits, n):
    """n greedy tokens per slot from a cache and the logits of its last position."""
    out = []
    for _ in range(n):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out.append(np.asarray(tok))
        logits, cache = steps.decode_step(cfg, params, cache, tok)
    return np.stack(out, 1)


# --- sampling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,msg", BAD_SAMPLING)
def test_sampling_params_out_of_range_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams.make(2, **kw)
    with pytest.raises(ValueError, match=msg):
        check_sampling(**{**dict(temperature=0.0, top_k=0, top_p=1.0), **kw})


def test_sample_refuses_bad_per_sequence_values_and_shapes():
    logits = jax.random.normal(jax.random.key(0), (3, 50))
    ok = SamplingParams.make(3, temperature=0.7, top_k=5, top_p=0.9)
    before = np.asarray(rjax.sample(logits, jax.random.key(1), ok))
    bad = [
        (dataclasses.replace(ok, temperature=jnp.asarray([0.7, jnp.nan, 0.7])), r"temperature\[1\] must be >= 0"),
        (dataclasses.replace(ok, top_p=jnp.asarray([0.9, 0.9, 0.0])), r"top_p\[2\] must be in \(0, 1\]"),
        (dataclasses.replace(ok, top_k=jnp.asarray([-3, 5, 5])), r"top_k\[0\] must be >= 0"),
        (dataclasses.replace(ok, top_k=jnp.asarray([5, 5])), r"SamplingParams.top_k has shape \(2,\).*\(3,\)"),
    ]
    for sp, msg in bad:
        with pytest.raises(ValueError, match=msg):
            rjax.sample(logits, jax.random.key(1), sp)
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        rjax.sample(logits[0], jax.random.key(1), ok)
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        SamplingParams.make(0)
    np.testing.assert_array_equal(np.asarray(rjax.sample(logits, jax.random.key(1), ok)), before)


# --- the functional core ----------------------------------------------------------------------

def test_functional_core_refuses_before_dispatch_and_the_cache_still_generates(tiny):
    cfg, params = tiny
    V = cfg.vocab_size
    prompts = [[5, 17, 300, 2, 9], [44, 1, 8]]
    cache = init_cache(cfg, 2, 32)
    t, l = steps.pad_prompts(prompts)
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(t), jnp.asarray(l))
    snap = _snapshot(cache)
    want = _greedy(cfg, params, _copy(cache), logits, 4)
    sp = SamplingParams.make(2)
    key = jax.random.key(0)
    full = init_cache(cfg, 2, 16)  # slot 0 filled to its last position below
    ft, fl = steps.pad_prompts([list(range(1, 17)), [3]])
    _, full = steps.prefill(cfg, params, full, jnp.asarray(ft), jnp.asarray(fl))
    full_snap = _snapshot(full)

    def pad(rows, width=16):
        out = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return jnp.asarray(out), jnp.asarray([len(r) for r in rows], jnp.int32)

    three, three_l = pad([[1], [2], [3]])
    long_t, long_l = pad([list(range(1, 29)), [1]], 32)  # slot 0 holds 5: 5 + 28 > 32
    bad_id_t, bad_id_l = pad([[1, V], [2]])
    neg_t, neg_l = pad([[1, 2], [-1]])
    one_t, one_l = pad([[1, 2], [3]])
    nan_sp = dataclasses.replace(sp, temperature=jnp.asarray([0.0, jnp.nan]))
    state = steps.initial_state(jnp.asarray([1, 2], jnp.int32), jnp.asarray([4, 4]), jnp.asarray([-1]), key, cache)
    stop = jnp.asarray([-1], jnp.int32)
    cases = [
        # more prompts than slots, and slots that would collide or fall outside the cache
        (lambda c: steps.prefill(cfg, params, c, three, three_l), ValueError,
         r"3 prompts for a cache of 2 slots.*n_slots=2"),
        (lambda c: steps.prefill(cfg, params, c, one_t, one_l, jnp.asarray([1, 1])), ValueError,
         r"slots \[1, 1\] name a cache row twice"),
        (lambda c: steps.prefill(cfg, params, c, one_t, one_l, jnp.asarray([0, 2])), ValueError,
         r"slots \[0, 2\] must be cache rows in \[0, 2\)"),
        # a prompt that does not fit after what its slot holds
        (lambda c: steps.prefill(cfg, params, c, long_t, long_l), PromptTooLongError,
         r"prompt 0 of 28 tokens after the 5 positions slot 0 holds needs 33 positions; the cache has max_len 32"),
        (lambda c: steps.prefill_and_sample(cfg, params, c, long_t, long_l, None, key, sp), PromptTooLongError,
         "needs 33 positions"),
        # empty prompts and lengths past the padding
        (lambda c: steps.prefill(cfg, params, c, one_t, jnp.asarray([2, 0])), ValueError,
         r"prompt 1 \(lengths\[1\] = 0\) is empty"),
        (lambda c: steps.prefill(cfg, params, c, one_t, jnp.asarray([17, 1])), ValueError,
         r"lengths\[0\] = 17\) is longer than the padded width 16"),
        # token ids outside the vocabulary (where the embedding lookup would clamp them)
        (lambda c: steps.prefill(cfg, params, c, bad_id_t, bad_id_l), ValueError,
         rf"tokens\[0, 1\] = {V} is outside the vocabulary \[0, {V}\)"),
        (lambda c: steps.prefill(cfg, params, c, neg_t, neg_l), ValueError, r"tokens\[1, 0\] = -1 is outside"),
        (lambda c: steps.decode_step(cfg, params, c, jnp.asarray([3, V + 7], jnp.int32)), ValueError,
         rf"tokens\[1\] = {V + 7} is outside the vocabulary"),
        # shapes and types
        (lambda c: steps.prefill(cfg, params, c, one_t[0], one_l), ValueError, r"tokens must be integer token ids"),
        (lambda c: steps.prefill(cfg, params, c, one_t.astype(jnp.float32), one_l), ValueError,
         "tokens must be integer token ids"),
        (lambda c: steps.decode_step(cfg, params, c, jnp.asarray([1, 2, 3], jnp.int32)), ValueError,
         r"tokens must be one token id per cache slot: \(2,\), got shape \(3,\)"),
        (lambda c: steps.decode_step(cfg, params, c, jnp.asarray([1, 2], jnp.int32), jnp.asarray([True])), ValueError,
         r"active must be one flag per cache slot"),
        # sampling settings out of range that were not made by SamplingParams.make
        (lambda c: steps.prefill_and_sample(cfg, params, c, one_t, one_l, None, key, nan_sp), ValueError,
         r"temperature\[1\] must be >= 0 and finite"),
        (lambda c: steps.prefill_and_sample(cfg, params, c, one_t, one_l, None, key, SamplingParams.make(3)),
         ValueError, r"SamplingParams.temperature must be one value per prompt: \(2,\)"),
        # decode_loop: its shapes and step count
        (lambda c: steps.decode_loop(cfg, params, c, state, sp, stop, 0), ValueError,
         "n_steps must be an integer >= 1, got 0"),
        (lambda c: steps.decode_loop(cfg, params, c, state, SamplingParams.make(1), stop, 4), ValueError,
         r"SamplingParams.temperature must be one value per cache slot: \(2,\)"),
        (lambda c: steps.decode_loop(cfg, params, c, state, sp, jnp.zeros((3, 2), jnp.int32), 4), ValueError,
         r"stop_ids must be integer ids \[K\] shared by all slots or \[2, K\]"),
    ]
    for call, error, msg in cases:
        with pytest.raises(error, match=msg):
            call(cache)
        _assert_unchanged(cache, snap)
        np.testing.assert_array_equal(_greedy(cfg, params, _copy(cache), logits, 4), want)
    # Decoding past the end of a cache row (max_new_tokens beyond it) is refused for that slot...
    with pytest.raises(ContextLengthError, match=r"slot 0 holds 16 positions, all of the cache's max_len 16"):
        steps.decode_step(cfg, params, full, jnp.asarray([1, 2], jnp.int32))
    _assert_unchanged(full, full_snap)
    # ...and runs for the other slots when the full one is left out.
    _, full = steps.decode_step(cfg, params, full, jnp.asarray([1, 2], jnp.int32), jnp.asarray([False, True]))
    np.testing.assert_array_equal(np.asarray(full.lengths), [16, 2])
    # The refused calls compiled nothing and the cache generates as it did.
    np.testing.assert_array_equal(_greedy(cfg, params, cache, logits, 4), want)


def test_checks_under_the_callers_jit_are_shape_only_and_compile_the_same_program(tiny):
    """Under a jit of the caller's the arguments are tracers: no value can be read, only shapes
    are checked, and the checks add nothing to the program (the same HLO as the bare jit)."""
    cfg, params = tiny
    cache = init_cache(cfg, 2, 32)
    tokens = jnp.asarray([3, 4], jnp.int32)
    checked = jax.jit(lambda c, t: steps.decode_step(cfg, params, c, t)).lower(cache, tokens).as_text()
    bare = jax.jit(lambda c, t: steps.decode_step.jitted(cfg, params, c, t)).lower(cache, tokens).as_text()
    assert checked == bare
    with pytest.raises(ValueError, match=r"tokens must be one token id per cache slot"):
        jax.jit(lambda c, t: steps.decode_step(cfg, params, c, t)).lower(cache, jnp.zeros(3, jnp.int32))


def test_pad_prompts_refuses_empty_input():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        rjax.pad_prompts([[1], []])
    with pytest.raises(ValueError, match="no prompts"):
        rjax.pad_prompts([])
    with pytest.raises(ValueError, match="bucket 16 is shorter than the longest prompt"):
        rjax.pad_prompts([list(range(20))], bucket=16)


# --- text generation --------------------------------------------------------------------------

def test_generate_and_stream_refuse_and_still_generate_the_same(model):
    cfg = model.config
    ctx = cfg.context_length
    want = rjax.generate(model, "hello there", raw=True, max_new_tokens=5).tokens
    n = len(model.tokenizer.encode("hello there"))
    small = dataclasses.replace(model, config=dataclasses.replace(cfg, context_length=32))
    cases = [
        # the context
        (lambda: rjax.generate(small, "x" * 40, raw=True, max_new_tokens=2), PromptTooLongError,
         r"prompt 0 has 40 tokens; the context of .* is 32 tokens"),
        (lambda: rjax.generate(model, "hello there", raw=True, max_new_tokens=ctx), ContextLengthError,
         rf"prompt 0 has {n} tokens and max_new_tokens is {ctx}: {ctx + n} positions, beyond the context of "
         rf"{ctx} tokens \(max_new_tokens can be at most {ctx - n}\)"),
        (lambda: rjax.generate(small, ["ok", "x" * 30], raw=True, max_new_tokens=4), ContextLengthError,
         r"prompt 1 has 30 tokens and max_new_tokens is 4: 34 positions"),
        # max_new_tokens and the other settings
        (lambda: rjax.generate(model, "hi", raw=True, max_new_tokens=0), ValueError,
         "max_new_tokens must be an integer >= 1, got 0"),
        (lambda: rjax.generate(model, "hi", raw=True, max_new_tokens=2.5), ValueError,
         "max_new_tokens must be an integer >= 1, got 2.5"),
        (lambda: rjax.generate(model, "hi", raw=True, steps_per_dispatch=0), ValueError,
         "steps_per_dispatch must be an integer >= 1"),
        (lambda: rjax.generate(model, "hi", raw=True, seed=2**64), ValueError, r"seed must be an integer in"),
        (lambda: rjax.generate(model, ["hi"], raw=True, n_slots=0), ValueError, "n_slots must be an integer >= 1"),
        # empty prompts (this tokenizer adds no BOS)
        (lambda: rjax.generate(model, "", raw=True), ValueError, "prompt 0 is empty"),
        (lambda: rjax.generate(model, ["a", ""], raw=True), ValueError, "prompt 1 is empty"),
        # text that is not UTF-8
        (lambda: rjax.generate(model, b"caf\xe9", raw=True), InvalidTextError,
         r"prompt is not valid UTF-8: byte 0xe9 at offset 3"),
        (lambda: rjax.generate(model, "caf\udce9", raw=True), InvalidTextError,
         r"prompt has an unpaired surrogate U\+DCE9 at index 3"),
        (lambda: rjax.generate(model, ["ok", b"\xff"], raw=True), InvalidTextError, "prompt 1 is not valid UTF-8"),
        (lambda: rjax.generate(model, 42), TypeError, "prompt must be a str"),
        # stream refuses when it is called, before the first chunk
        (lambda: rjax.stream(model, b"\xc3(", raw=True), InvalidTextError, "byte 0xc3 at offset 0"),
        (lambda: rjax.stream(model, "hi", raw=True, max_new_tokens=ctx), ContextLengthError, "beyond the context"),
        (lambda: rjax.stream(model, "hi", raw=True, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        # token ids through the id-level generator
        (lambda: stream_ids(model, [[1, cfg.vocab_size]]), ValueError,
         rf"prompt 0 has token id {cfg.vocab_size} at position 1, outside the vocabulary \[0, {cfg.vocab_size}\)"),
        (lambda: stream_ids(model, [[1, 2.0]]), ValueError, "prompt 0 has token id 2.0 at position 1"),
        (lambda: stream_ids(model, []), ValueError, "no prompts"),
        (lambda: stream_ids(model, [[1, 2]], cache=init_cache(cfg, 2, 32)), ValueError,
         "the cache has 2 slots for 1 prompts"),
    ] + [(lambda kw=kw: rjax.generate(model, "hi", raw=True, **kw), ValueError, msg) for kw, msg in BAD_SAMPLING]
    for call, error, msg in cases:
        with pytest.raises(error, match=msg):
            call()
    assert rjax.generate(model, "hello there", raw=True, max_new_tokens=5).tokens == want
    # UTF-8 bytes are text like any other.
    assert rjax.generate(model, "hello there".encode(), raw=True, max_new_tokens=5).tokens == want
    assert check_text(bytearray("é".encode())) == "é"


def test_stream_ids_with_a_cache_refuses_a_full_slot_and_keeps_the_cache(model):
    cfg = model.config
    cache = init_cache(cfg, 1, 256)
    stats: dict = {}
    list(stream_ids(model, [[7, 8, 9]], max_new_tokens=3, stats=stats, cache=cache))
    cache = stats["cache"]  # holds 5 positions
    snap = _snapshot(cache)
    with pytest.raises(PromptTooLongError, match=r"prompt 0 of 251 tokens after the 5 positions its slot holds "
                                                 r"leaves no room to generate in a cache of 256 positions"):
        stream_ids(model, [[1] * 251], cache=cache)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        stream_ids(model, [[1]], cache=cache, temperature=-1.0)
    _assert_unchanged(cache, snap)
    a = [t for s in stream_ids(model, [[4, 5]], max_new_tokens=4, cache=_copy(cache)) for t in s[0]]
    b = [t for s in stream_ids(model, [[4, 5]], max_new_tokens=4, cache=cache) for t in s[0]]
    assert a == b


def test_a_refused_chat_turn_leaves_the_session_as_it_was(model):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    model = dataclasses.replace(model, tokenizer=dataclasses.replace(model.tokenizer, chat_template=template))
    session = ChatSession(model, max_new_tokens=4)
    list(session.send("hello"))
    messages, cached = list(session.messages), list(session.cached_ids)
    snap = _snapshot(session.cache)
    with pytest.raises(InvalidTextError, match=r"message has an unpaired surrogate U\+DC80"):
        list(session.send("bad \udc80"))
    bad = dataclasses.replace(session, temperature=float("nan"))
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
        list(bad.send("again"))
    assert session.messages == messages and session.cached_ids == cached
    _assert_unchanged(session.cache, snap)
    twin = ChatSession(model, max_new_tokens=4)
    list(twin.send("hello"))
    assert "".join(session.send("and now?")) == "".join(twin.send("and now?"))
    assert session.messages == twin.messages


# --- scoring ----------------------------------------------------------------------------------

def test_score_refuses_bad_text_and_ids(model):
    cfg = model.config
    want = [s.logprob for s in rjax.score(model, "the cat", [" sat", " ran"])]
    cases = [
        (lambda: rjax.score(model, b"\xff the", " sat"), InvalidTextError, "context is not valid UTF-8"),
        (lambda: rjax.score(model, "the cat", [" sat", "\ud800"]), InvalidTextError,
         r"continuation 1 has an unpaired surrogate U\+D800"),
        (lambda: rjax.score(model, "the cat", []), ValueError, "no continuations"),
        (lambda: scoring.score_ids(cfg, model.params, [[1, 2]], [[cfg.vocab_size]]), ValueError,
         rf"continuation 0 has token id {cfg.vocab_size} at position 0, outside the vocabulary"),
        (lambda: scoring.score_ids(cfg, model.params, [[-1, 2]], [[3]]), ValueError,
         "prompt 0 has token id -1 at position 0"),
        (lambda: rjax.perplexity(model, "a\udc00" * 40, ctx=16, progress=False), InvalidTextError,
         "text has an unpaired surrogate"),
        (lambda: scoring.perplexity_of_ids(cfg, model.params, [1, 2, 600] * 10, ctx=8, progress=False), ValueError,
         "the text has token id 600 at position 2"),
    ]
    for call, error, msg in cases:
        with pytest.raises(error, match=msg):
            call()
    assert [s.logprob for s in rjax.score(model, "the cat".encode(), [" sat", b" ran"])] == want


# --- serving ----------------------------------------------------------------------------------

SERVING = ServingConfig(n_slots=2, max_len=32, page_size=8, steps_per_dispatch=4, prefill_buckets=(2,))


def test_serving_submit_refuses_and_the_engine_still_serves_the_same(tiny):
    """What ServingEngine.submit refuses (its own checks, and check_sampling's)."""
    cfg, params = tiny
    eng = ServingEngine(cfg, params, SERVING)

    def serve(prompt):
        rid = eng.submit(prompt, max_new_tokens=6)
        return [e.completion.tokens for e in eng.run() if e.finished and e.request_id == rid][0]

    want = serve([5, 6, 7])
    cases = [
        (dict(prompt=list(range(32))), r"prompt of 32 tokens: ServingConfig.max_len is 32"),
        (dict(prompt=[]), "empty prompt"),
        (dict(prompt=[1, cfg.vocab_size]), r"prompt has token id 512 at position 1, outside the vocabulary \[0, 512"),
        (dict(prompt=[-1]), "prompt has token id -1 at position 0, outside the vocabulary"),
        (dict(prompt=[1], max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(prompt=[1], stop_ids=[cfg.vocab_size]), "stop_ids has token id 512 at position 0, outside the"),
        (dict(prompt=[1], stop_ids=list(range(9))), "ServingConfig.max_stop_ids is 8"),
    ] + [(dict(prompt=[1], **kw), msg) for kw, msg in BAD_SAMPLING]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.submit(**kw)
        assert eng.n_queued == 0 and not eng.has_work
    assert serve([5, 6, 7]) == want
    # The typed request, checked when built: submitted as is, it runs as the keyword form does.
    request = eng.limits.request([5, 6, 7], max_new_tokens=6, presence_penalty=0.0)
    assert (request.prompt, request.stop_ids, request.adjust, request.seed) == ((5, 6, 7), eng.default_stop_ids, {}, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_new_tokens = 7
    with pytest.raises(TypeError, match="a Request carries its settings; got temperature too"):
        eng.submit(request, temperature=0.5)
    with pytest.raises(TypeError, match="unexpected request argument"):
        eng.limits.request([5], max_new_tokens=6, temprature=0.5)
    rid = eng.submit(request)
    assert [e.completion.tokens for e in eng.run() if e.finished and e.request_id == rid] == [want]


@pytest.mark.parametrize("kw, error, msg", [
    # what int() would have taken: the bytes of a text, fractional ids and budgets, bools
    (dict(prompt=b"hello"), TypeError, "prompt must be a sequence of token ids, got bytes"),
    (dict(prompt="hello"), TypeError, "prompt must be a sequence of token ids, got str"),
    (dict(prompt=7), TypeError, "prompt must be a sequence of token ids, got int"),
    (dict(prompt=[1.7, 2.2]), ValueError, "prompt has token id 1.7 at position 0, a float: token ids are integers"),
    (dict(prompt=[True, 2]), ValueError, "prompt has token id True at position 0, a bool"),
    (dict(prompt=np.array([1.0, 2.0])), ValueError, "prompt has token id .* at position 0, a float64"),
    (dict(prompt=[1], max_new_tokens=2.5), ValueError, "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(prompt=[1], max_new_tokens=True), ValueError, "max_new_tokens must be an integer >= 1, got True"),
    (dict(prompt=[1], stop_ids=[2.0]), ValueError, "stop_ids has token id 2.0 at position 0, a float"),
    (dict(prompt=[1], stop_ids=b"\x02"), TypeError, "stop_ids must be a sequence of token ids, got bytes"),
    # NaN and infinities
    (dict(prompt=[1], max_new_tokens=float("nan")), ValueError, "max_new_tokens must be an integer >= 1, got nan"),
    (dict(prompt=[1], max_new_tokens=float("inf")), ValueError, "max_new_tokens must be an integer >= 1, got inf"),
    (dict(prompt=[1], seed=float("nan")), ValueError, "seed must be an integer or None, got nan"),
    (dict(prompt=[1], seed=2.5), ValueError, "seed must be an integer or None, got 2.5"),
    (dict(prompt=[1], sample_index=float("inf")), ValueError, r"sample_index must be an integer in \[0, 2\*\*32\)"),
    (dict(prompt=[1], sample_index=-1), ValueError, r"sample_index must be an integer in \[0, 2\*\*32\), got -1"),
    (dict(prompt=[1], logprobs="yes"), TypeError, "logprobs must be a bool, got 'yes'"),
    # a prompt plus max_new_tokens beyond max_len (32)
    (dict(prompt=[1] * 20, max_new_tokens=13), ContextLengthError,
     r"prompt of 20 tokens and max_new_tokens 13: 33 positions, beyond ServingConfig.max_len of 32 "
     r"\(max_new_tokens can be at most 12\)"),
    (dict(prompt=[1]), ContextLengthError, "max_new_tokens 256: 257 positions"),  # the default budget
    (dict(prompt=[1] * 32, max_new_tokens=1), PromptTooLongError, "prompt of 32 tokens"),
])
def test_serving_submit_refuses_bad_types_and_budgets(tiny, kw, error, msg):
    cfg, params = tiny
    eng = ServingEngine(cfg, params, SERVING)
    with pytest.raises(error, match=msg):
        eng.submit(**kw)
    with pytest.raises(error, match=msg):
        eng.check_request(**kw)
    with pytest.raises(error, match=msg):
        eng.limits.request(**kw)
    assert eng.n_queued == 0 and not eng.has_work

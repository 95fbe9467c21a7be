"""Constrained decoding: token bitmasks applied on the device (against llguidance's own NumPy
masking), and through the serving engine: constrained requests (a regex, a JSON schema) share
a batch with free ones, every constrained output matches its constraint, and a free request's
tokens are those it gets alone (tiny synthetic model on the CPU)."""
from __future__ import annotations

import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import rjax
from rjax.math.sampling import mask_logits
from rjax.runtime.grammar import GrammarError, Grammars, allowed
from rjax.runtime.serving import ServingConfig, ServingEngine

CONFIG = ServingConfig(n_slots=4, max_len=64, page_size=8, steps_per_dispatch=4, prefill_buckets=(4,))


def test_mask_logits_is_llguidances_numpy_masking():
    import llguidance.numpy as lln

    rng = np.random.default_rng(0)
    V = 70   # not a multiple of 32: the last word is partly past the vocabulary
    logits = rng.normal(size=(3, V)).astype(np.float32)
    mask = rng.integers(-2 ** 31, 2 ** 31, size=(3, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    mask[2] = -1
    want = logits.copy()
    lln.apply_token_bitmask_inplace(want, mask)
    got = np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(allowed(mask[0], V), np.isfinite(want[0]))


@pytest.fixture(scope="module")
def model(tiny_path):
    return rjax.load(tiny_path, progress=False)


@pytest.fixture(scope="module")
def grammars(model):
    return Grammars(model.tokenizer, model.config.vocab_size, sorted(model.tokenizer.eos_ids))


def test_constrained_and_free_requests_share_a_batch(model, grammars):
    tok, eos = model.tokenizer, sorted(model.tokenizer.eos_ids)
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
                                               "tag": {"type": "string", "enum": ["a", "b"]}},
              "required": ["id", "ok", "tag"], "additionalProperties": False}
    regex = r"[a-c]{3}-[0-9]{2}"
    prompt = tok.encode("hello")

    def run(constrained: bool):
        eng = ServingEngine(model.config, model.params, CONFIG, stop_ids=eos)
        ids = [eng.submit(prompt, max_new_tokens=20)]
        if constrained:
            ids += [eng.submit(prompt, max_new_tokens=30, constraint=grammars.constraint("regex", regex)),
                    eng.submit(prompt, max_new_tokens=40, temperature=1.0, seed=2,
                               constraint=grammars.constraint("json_schema", schema))]
        done = {e.request_id: e.completion for e in eng.run() if e.finished}
        return [done[i] for i in ids]

    free, text, obj = run(True)
    assert free.tokens == run(False)[0].tokens
    for c in (text, obj):
        assert c.finish_reason == "stop" and c.tokens[-1] in eos
    assert re.fullmatch(regex, tok.decode(text.tokens))
    jsonschema.validate(json.loads(tok.decode(obj.tokens)), schema)


def test_a_bad_constraint_is_a_grammar_error(grammars):
    with pytest.raises(GrammarError, match="json_schema"):
        grammars.constraint("json_schema", {"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(GrammarError, match="regex|grammar"):
        grammars.constraint("regex", "a(")
    with pytest.raises(GrammarError, match="unknown constraint kind"):
        grammars.constraint("xml", "<a/>")


def _allows(grammars, model, schema, text: str) -> bool:
    """Whether the automaton of `schema` lets the model write `text` (every token in the mask)."""
    c = grammars.constraint("json_schema", schema)
    for t in model.tokenizer.encode(text):
        if not allowed(c.mask(), model.config.vocab_size)[t]:
            return False
        c.advance(t)
    return True


def test_unbounded_numbers_are_bounded_and_stated_bounds_kept(grammars, model):
    """A number that never ends ("0.000122222...") cannot be written: unbounded numbers get
    JSON's exact integer range and at most 9 decimals; bounds the schema states are its own,
    and data keywords (const, enum) are not touched."""
    from rjax.runtime.grammar import bound_numbers

    number = {"type": "number"}
    assert _allows(grammars, model, number, "0.000122") and _allows(grammars, model, number, "-3")
    assert not _allows(grammars, model, number, "0.000122222222222")
    assert not _allows(grammars, model, {"type": "integer"}, "12345678901234567890")
    assert _allows(grammars, model, {"type": ["integer", "null"]}, "null")
    assert not _allows(grammars, model, {"type": "number", "minimum": 0, "maximum": 1}, "3")
    schema = {"type": "object", "properties": {"type": {"type": "number", "minimum": 2}},
              "const": {"type": "number"}}
    assert bound_numbers(schema) == {"type": "object", "const": {"type": "number"},
                                     "properties": {"type": {"type": "number", "minimum": 2,
                                                             "maximum": 2 ** 53 - 1, "multipleOf": 1e-9}}}

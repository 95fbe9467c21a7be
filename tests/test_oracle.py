"""The oracle checked on its own: transformers' answers must be sane before rjax is compared to them.

Nothing from rjax is used here, so a broken oracle cannot hide behind a matching rjax bug.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.oracle.client import oracle_logits, oracle_random_qwen2, oracle_tokenize

pytestmark = pytest.mark.oracle


def _prompt_and_first_token(model_path, prompt: str, word: str) -> tuple[dict, int]:
    """The oracle's tokenization of `prompt` (the whole answer) and the first id of `word` without
    special tokens, from one oracle run: each run loads the tokenizer from the GGUF anew (16 s for
    gemma3's on the 2-core CPU box)."""
    tokens = oracle_tokenize(model_path, [prompt, word])
    return tokens, tokens["ids_without_special"][1][0]


def _check_logits_consistent(result: dict, steps: int, greedy: int) -> None:
    last, step_tokens, step_logits = result["last_logits"], result["step_tokens"], result["step_logits"]
    assert np.isfinite(last).all() and np.isfinite(step_logits).all()
    assert step_tokens.shape == (steps,) and step_logits.shape == (steps, last.shape[0])
    assert result["greedy"].shape == (max(steps, greedy),)
    # Greedy bookkeeping: each fed token is the argmax of the logits before it.
    assert step_tokens[0] == np.argmax(last)
    assert np.array_equal(np.argmax(step_logits[:-1], axis=-1), step_tokens[1:])
    assert np.array_equal(result["greedy"][:steps], step_tokens)
    # A real distribution, not a constant: the top logit stands out.
    assert last.max() - np.median(last) > 5.0


def test_smollm2_oracle_answers_paris(smollm2_path):
    tokens, paris = _prompt_and_first_token(smollm2_path, "The capital of France is", " Paris")
    prompt = tokens["ids_with_special"][:1]
    (result,) = oracle_logits(smollm2_path, prompt, decode_steps=4, all_positions=True, greedy_tokens=8)
    _check_logits_consistent(result, steps=4, greedy=8)
    assert paris == result["greedy"][0]
    # The prompt's last position in the full-sequence pass is the same computation as last_logits.
    assert result["all_logits"].shape == (len(prompt[0]), 49152)
    np.testing.assert_allclose(result["all_logits"][-1], result["last_logits"], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_gemma3_oracle_answers_berlin(gemma3_path):
    """transformers loads the gemma3 Q4_K_M GGUF (Q4_K, Q5_0, Q6_K, Q8_0 tensors) and continues a pattern."""
    prompt, berlin = _prompt_and_first_token(gemma3_path, "The capital of France is Paris. The capital of Germany is",
                                             " Berlin")
    ids = prompt["ids_with_special"][:1]
    assert ids[0][0] == prompt["bos_token_id"] == 2
    (result,) = oracle_logits(gemma3_path, ids, decode_steps=4, greedy_tokens=8)
    _check_logits_consistent(result, steps=4, greedy=8)
    assert result["last_logits"].shape == (262144,)
    assert berlin == result["greedy"][0]


@pytest.mark.parametrize("tie", [True, False])
def test_random_qwen2_checkpoint(tie):
    directory = oracle_random_qwen2(seed=3, tie_word_embeddings=tie)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is tie
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (64, 2, 4, 2)
    weights = load_file(directory / "model.safetensors")
    assert ("lm_head.weight" in weights) is (not tie)
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], 64)
    # Biases and norm weights are randomized, so a reader that drops them is caught.
    assert np.abs(weights["model.layers.0.self_attn.q_proj.bias"]).min() > 0
    assert np.std(weights["model.layers.1.input_layernorm.weight"]) > 0.01
    tokens = oracle_tokenize(directory, ["Hello there, the cat is in the house."])["ids_without_special"]
    (result,) = oracle_logits(directory, tokens, decode_steps=3, all_positions=True)
    assert result["all_logits"].shape == (len(tokens[0]), config["vocab_size"])
    assert np.isfinite(result["all_logits"]).all()
    assert np.array_equal(result["step_tokens"][1:], np.argmax(result["step_logits"][:-1], axis=-1))


def test_missing_oracle_env_names_the_fix(monkeypatch, tmp_path):
    import tests.oracle.client as client

    monkeypatch.setattr(client, "ORACLE_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setattr(client, "CACHE_DIR", tmp_path / "cache")
    (tmp_path / "model.gguf").write_bytes(b"not cached")
    with pytest.raises(client.OracleUnavailable, match=r"scripts/bootstrap\.sh oracle"):
        client.oracle_tokenize(tmp_path / "model.gguf", ["hi"])

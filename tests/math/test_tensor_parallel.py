"""Tensor parallel (rjax.math.tensor_parallel): a model split over 2, 4 and 8 devices gives the logits
(within 1e-4 of the largest, float32) and greedy tokens of the same model on one device.

The runs need 8 devices, which the CPU platform only makes when told before JAX starts, so each
model runs in a fresh process (tests/tp_worker.py) with 8 forced host devices; the test compares
what it writes. Shapes cover even splits, padded heads (3 KV heads over 2, 4, 8 devices), one
KV head copied onto every device (gemma3-270m), q/k/v biases with stacked projections (a
random Qwen2), and mixtures of experts (tiny Mixtral and Qwen3-MoE).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rjax.engine.memory import MemoryFitError, plan_memory
from rjax.loading.synth import write_synthetic
from rjax.math.config import ModelConfig
from rjax.math.tensor_parallel import head_layout, local_config, split_config

ROOT = Path(__file__).resolve().parents[2]
TPS = (2, 4, 8)


def split_runs(model: Path, tmp_path: Path, *extra: str, tps=TPS) -> dict:
    out = tmp_path / f"{model.stem}.npz"
    subprocess.run([sys.executable, str(ROOT / "tests" / "tp_worker.py"), str(model), str(out), "--tp",
                    ",".join(map(str, tps)), *extra], check=True, cwd=ROOT, timeout=3000)
    return dict(np.load(out))


def check_equal(r: dict, engines: bool = True, tps=TPS) -> None:
    ref = r["1/logits"]
    for n in tps:
        err = np.abs(r[f"{n}/logits"] - ref).max() / np.abs(ref).max()
        assert err < 1e-4, (n, err)
        assert (r[f"{n}/greedy"] == r["1/greedy"]).all(), n
        if engines:  # rjax.generate's batch path and the serving engine, over the split model
            assert (r[f"{n}/generate"] == r["1/generate"]).all(), n
            assert (r[f"{n}/serving"] == r["1/serving"]).all(), n
        if f"{n}/speculative" in r:  # drafted and verified: greedy, the plain engine's tokens
            assert (r[f"{n}/speculative"] == r["1/serving"]).all(), n


@pytest.mark.parametrize("n_heads, n_kv, n", [(9, 3, 2), (9, 3, 4), (9, 3, 8), (4, 1, 2), (4, 1, 8), (32, 8, 2),
                                              (12, 2, 8), (64, 8, 8), (14, 2, 4)])
def test_head_layout_gives_every_device_whole_groups(n_heads, n_kv, n):
    """Each original q head appears once, each device holds the same number of q and KV heads,
    and every real q head sits on a device holding (a copy of) its own KV head."""
    lay = head_layout(n_heads, n_kv, n)
    assert sorted(h for h in lay.q if h is not None) == list(range(n_heads))
    assert len(lay.q) % n == 0 and len(lay.kv) % n == 0
    q_per, kv_per = len(lay.q) // n, len(lay.kv) // n
    group = len(lay.q) // len(lay.kv)  # the split model's own grouping (q head i reads KV head i // group)
    for i, h in enumerate(lay.q):
        if h is not None:
            assert lay.kv[i // group] == h // (n_heads // n_kv)
            assert i // q_per == (i // group) // kv_per  # q head and its KV head on one device


def test_split_config_refuses_an_ffn_that_does_not_divide(tiny):
    cfg, _ = tiny
    with pytest.raises(ValueError, match="feed-forward size 1536 does not split into 5"):
        split_config(cfg, 5)


def test_memory_plan_counts_one_device_and_says_which_tp_fits(tiny):
    cfg, _ = tiny
    params, avail = 6 << 30, 4 << 30
    with pytest.raises(MemoryFitError, match=r"--tp 2\b"):
        plan_memory(cfg, max_len=2048, n_slots=4, params_bytes=params, available=avail, reserve_bytes=0)
    plan = plan_memory(cfg, max_len=2048, n_slots=4, params_bytes=params, available=avail, reserve_bytes=0, tp=2)
    one = plan_memory(cfg, max_len=2048, n_slots=4, available=avail, reserve_bytes=0)
    assert plan.params_bytes == params // 2 and plan.kv_bytes == one.kv_bytes // 2


def test_tiny_llama_split_over_2_4_8_devices(tiny_path, tmp_path):
    """3 KV heads and 9 q heads: padded to 4 / 12 (2 and 4 devices) and 8 / 16 (8 devices).
    Also rjax.generate and the serving engine over the split model, plain and (over 2 devices)
    speculative, with a draft model on one device beside the split target; and the params are split: the fullest
    device holds about total / N."""
    r = split_runs(tiny_path, tmp_path, "--draft-tp", "2")
    assert "2/speculative" in r
    check_equal(r)
    for n in TPS:
        per_device, total = r[f"{n}/bytes"]
        # Replicated: the (small) embedding and the norms; everything else is split N ways.
        assert per_device <= total / n * 1.05 + 320_000, (n, per_device, total)


def test_mixture_of_experts_split_over_2_4_8_devices(tiny_moe_path, tmp_path):
    """Every expert's feed-forward units split over the devices, the router on each: Mixtral's
    experts of 64 over 2 and 4 devices (Q5_0 down columns whole blocks over 2, split as values
    over 4) and Qwen3-MoE's of 32 over 8 (Q8_0, 4 units per device, its 2 KV heads copied);
    prefill grouped by expert, decode of 3 rows gathered."""
    tps = (2, 4) if "mixtral" in tiny_moe_path.stem else (8,)
    r = split_runs(tiny_moe_path, tmp_path, "--logits-only", "--steps", "3", tps=tps)
    check_equal(r, engines=False, tps=tps)
    for n in tps:
        per_device, total = r[f"{n}/bytes"]
        # replicated: the embedding, the router and the norms (about 30 kB); the experts are split N ways
        assert per_device <= total / n + 40_000, (n, per_device, total)


def test_split_config_refuses_experts_that_do_not_divide():
    cfg = ModelConfig(arch="llama", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64,
                      vocab_size=512, context_length=256, rope_theta=1e4, rms_eps=1e-5, n_experts=8,
                      n_experts_used=2, expert_d_ff=48)
    with pytest.raises(ValueError, match=r"experts' feed-forward size 48 \(expert_d_ff\) does not split into 5"):
        split_config(cfg, 5)
    assert split_config(cfg, 4).expert_d_ff == 48 and local_config(split_config(cfg, 4), 4).expert_d_ff == 12


@pytest.mark.slow
def test_random_qwen2_with_biases_stacked(tmp_path):
    """q/k/v biases, 2 KV heads (copied over 4 and 8 devices), and stacked q/k/v and gate/up
    weights as a GPU loads them, split so that each device's rows are its own stacked weight."""
    path = write_synthetic(tmp_path / "qwen.gguf", "qwen2.5-1.5b", "q8_0", seed=5, n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    check_equal(split_runs(path, tmp_path, "--fuse", "--steps", "3"))


@pytest.mark.slow
def test_default_model_split_over_2_4_8_devices(smollm2_path, tmp_path):
    check_equal(split_runs(smollm2_path, tmp_path, "--logits-only", "--steps", "3"), engines=False)


@pytest.mark.slow
def test_gemma3_one_kv_head_on_every_device(gemma3_path, tmp_path):
    check_equal(split_runs(gemma3_path, tmp_path, "--logits-only", "--steps", "3"), engines=False)

"""`rjax bench` on a tiny synthetic model (CPU): the JSON's fields, the roofline's byte counts
against the file and hand-computed KV sizes, compiled-program counts, budget and plot."""
import dataclasses
import importlib.util
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFReader

from rjax.cli.bench import BenchSettings, run_bench
from rjax.cli.bench_report import RESULT_KEYS, format_table, plot, summarize
from rjax.engine import steps
from rjax.engine.roofline import decode_weight_bytes, kv_bytes_per_sequence, measure_bandwidth, roofline
from rjax.loading.loaders.gguf import load_gguf
from rjax.loading.synth import write_synthetic
from rjax.math.cache import init_cache
from rjax.math.config import ModelConfig
from rjax.math.model import Params
from rjax.math.params import LayerParams
from rjax.math.sampling import SamplingParams

PROMPT, GEN, BATCHES, STEPS, REPEATS = 20, 4, (1, 2), (1, 2), 2
N_LAYERS, N_KV, HEAD_DIM = 1, 3, 64  # the smollm2 shape, 1 block


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("bench") / "tiny.gguf", "smollm2-135m", "q4_1",
                           n_layers=N_LAYERS, vocab_size=1024, tokenizer_from="builtin")


@pytest.fixture(scope="module")
def cli_run(model_path, tmp_path_factory):
    """One `rjax bench` run through the command line, with --json and --plot."""
    from rjax.cli.main import main

    out = tmp_path_factory.mktemp("bench-out")
    argv = ["bench", "-m", str(model_path), "--prompt-len", str(PROMPT), "--gen", str(GEN),
            "--batch", ",".join(map(str, BATCHES)), "--steps-per-dispatch", ",".join(map(str, STEPS)),
            "--repeats", str(REPEATS), "--copy-mib", "8", "--json", str(out / "r.json"), "-q"]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(out / "r.png")]
    except ImportError:
        pass
    # The bench counts the programs it compiles; start cold, whatever this worker compiled before.
    jax.clear_caches()
    rc = main(argv)
    return rc, json.loads((out / "r.json").read_text()), out


@pytest.fixture(scope="module")
def result(cli_run):
    return cli_run[1]


def test_json_has_every_field(cli_run, result):
    assert cli_run[0] == 0
    assert set(RESULT_KEYS) <= set(result)
    assert result["status"] == "done" and not result["skipped"] and not result["errors"]
    assert result["settings"]["persistent_compilation_cache"] is False
    assert [p["batch"] for p in result["prefill"]] == list(BATCHES)
    assert sorted((d["batch"], d["steps_per_dispatch"]) for d in result["decode"]) == [
        (b, n) for b in BATCHES for n in STEPS]
    for p in result["prefill"]:
        assert p["tokens_per_s"] == pytest.approx(p["batch"] * PROMPT / p["time_s"])
        assert p["first_call_s"] >= p["compile_s"] >= 0
    for d in result["decode"]:
        b, n = d["batch"], d["steps_per_dispatch"]
        # forced generation: every slot made every token of every dispatch
        assert d["tokens"] == d["runs"] * b * n * math.ceil(GEN / n)
        assert d["runs"] == REPEATS
        assert min(d["tokens_per_s_runs"]) <= d["tokens_per_s"] <= max(d["tokens_per_s_runs"])
        pt = d["per_token_s"]
        assert 0 < pt["p50"] <= pt["p90"] <= pt["p99"]
        assert d["host_s_per_token"] > 0 and d["first_call_s"] > 0
        assert d["roofline_fraction"] == pytest.approx(d["tokens_per_s"] / d["roofline"]["tokens_per_s"])
    s = result["summary"]
    assert s["pp"] == result["prefill"][0]["tokens_per_s"]
    assert s["tg"] == max(d["tokens_per_s"] for d in result["decode"] if d["batch"] == 1)
    assert set(s["decode_by_batch"]) == {str(b) for b in BATCHES}
    comp = result["compile"]
    ahead = comp["ahead"]  # every program of the run, compiled before anything was timed
    assert sorted(ahead["programs"]) == sorted([f"prefill B={b} T=32" for b in BATCHES]
                                               + [f"decode B={b} N={n}" for b in BATCHES for n in STEPS])
    assert ahead["total_s"] == pytest.approx(ahead["lower_s"] + ahead["wall_s"])
    first_calls = [v for fn in ("prefill_and_sample", "decode_loop") for v in comp[fn].values()]
    assert len(first_calls) == len(BATCHES) * (1 + len(STEPS))
    assert s["compile_s_total"] == pytest.approx(ahead["total_s"] + sum(first_calls))
    assert set(s["host_s_per_token_by_steps"]) == {str(n) for n in STEPS}


def test_bytes_per_step_match_the_file_and_the_kv_cache(model_path, result):
    reader = GGUFReader(model_path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert result["model"]["weight_bytes"] == file_bytes
    assert result["model"]["tied_embeddings"] is True  # so the whole embedding is read as the head
    itemsize = 4  # float32 activations and cache on CPU
    context = PROMPT + 1 + GEN / 2
    kv_per_seq = 2 * N_LAYERS * N_KV * HEAD_DIM * context * itemsize
    assert result["settings"]["kv_bytes_per_sequence"] == pytest.approx(kv_per_seq)
    bw = result["bandwidth"]["bytes_per_s"]
    for d in result["decode"]:
        rf, b = d["roofline"], d["batch"]
        assert rf["bytes_per_step"] == int(file_bytes + b * kv_per_seq)
        assert rf["tokens_per_s"] == pytest.approx(b * bw / (file_bytes + b * kv_per_seq))


def test_compiled_programs_counted(result):
    rc = result["recompilation"]
    assert rc["prefill_and_sample"] == {"programs": len(BATCHES), "expected": len(BATCHES), "ok": True}
    assert rc["decode_loop"] == {"programs": len(BATCHES) * len(STEPS), "expected": len(BATCHES) * len(STEPS),
                                 "ok": True}
    check = result["prefill"][0]["same_bucket_length"]
    assert check == {"prompt_len": 17, "checked": True, "new_programs": 0, "ok": True}


def test_no_recompile_across_prompt_lengths_in_a_bucket(model_path):
    cfg, params, _ = load_gguf(model_path, progress=False)
    before = None
    for n in (17, 24, 32):  # all in the 32 bucket; ragged within the batch too
        tokens, lengths = steps.pad_prompts([list(range(1, n + 1)), list(range(3, n // 2 + 3))])
        assert tokens.shape == (2, 32)
        cache = init_cache(cfg, 2, 256)
        first, _ = steps.prefill_and_sample(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), None,
                                             jax.random.key(0), SamplingParams.make(2))
        np.asarray(first)
        size = steps.prefill_and_sample.compiled_count()
        if before is not None:
            assert size == before, f"prompt length {n} compiled a new program"
        before = size


def test_decode_reads_only_the_embedding_rows_and_experts_it_uses():
    cfg = ModelConfig(arch="llama", n_layers=1, d_model=8, d_ff=16, n_heads=2, n_kv_heads=1, head_dim=4,
                      vocab_size=100, context_length=64, rms_eps=1e-5, rope_theta=1e4)
    emb = jnp.zeros((100, 8), jnp.float32)
    untied = Params(embed=emb, layers=(), final_norm=jnp.ones(8, jnp.float32), lm_head=jnp.zeros((100, 8), jnp.float16))
    # head 1600 + norm 32 + 4 rows of 32 bytes
    assert decode_weight_bytes(cfg, untied, 4) == 1600 + 32 + 4 * 32
    tied = Params(embed=emb, layers=(), final_norm=jnp.ones(8, jnp.float32), lm_head=None)
    assert decode_weight_bytes(cfg, tied, 4) == 3200 + 32
    # a mixture reads each token's experts: 2 of 8 at batch 1 (of 64 bytes each), all 8 from batch 4
    moe = dataclasses.replace(cfg, n_experts=8, n_experts_used=2, expert_d_ff=1)
    layer = LayerParams(attn_norm=None, wq=None, wk=None, wv=None, wo=None, ffn_norm=None, w_gate=None, w_up=None,
                        w_down=None, w_gate_exps=jnp.zeros((8, 1, 8), jnp.float16),
                        w_up_exps=jnp.zeros((8, 1, 8), jnp.float16), w_down_exps=jnp.zeros((8, 8, 1), jnp.float16))
    mixture = dataclasses.replace(tied, layers=(layer,))
    assert [decode_weight_bytes(moe, mixture, b) for b in (1, 2, 4, 8)] == [3232 + 2 * 48, 3232 + 4 * 48,
                                                                            3232 + 8 * 48, 3232 + 8 * 48]
    rf = roofline(1000, 50.0, 4, 1e6)
    assert rf["bytes_per_step"] == 1200 and rf["tokens_per_s"] == pytest.approx(4 * 1e6 / 1200)


def test_kv_bytes_respect_sliding_windows():
    cfg = ModelConfig(arch="gemma3", n_layers=6, d_model=16, d_ff=32, n_heads=2, n_kv_heads=1, head_dim=8,
                      vocab_size=64, context_length=4096, rms_eps=1e-6, rope_theta=1e6,
                      layer_windows=(512,) * 5 + (None,))
    per_position = 2 * 1 * 8 * 2  # K and V, one head of 8, bfloat16
    assert kv_bytes_per_sequence(cfg, 1000, 2) == per_position * (5 * 512 + 1000)
    assert kv_bytes_per_sequence(cfg, 100, 2) == per_position * 6 * 100


def test_bandwidth_is_the_fastest_probe_counting_reads_and_writes():
    bw = measure_bandwidth(4 << 20, repeats=3, passes=2, batches=4)
    assert bw["array_bytes"] == 4 << 20 and set(bw["probes"]) == {"copy", "add_one", "negate"}
    # A copy moves the array once each way; an elementwise dispatch does it once per pass.
    assert bw["bytes_moved"] == 2 * (4 << 20) * (1 if bw["probe"] == "copy" else 2)
    # A probe's rate is its fastest batch: a slower one was held back by something else.
    assert len(bw["samples_s"]) == 4 and bw["best_s"] == min(bw["samples_s"])
    assert bw["bytes_per_s"] == pytest.approx(bw["bytes_moved"] / bw["best_s"]) and bw["gb_per_s"] > 0
    assert bw["gb_per_s"] == pytest.approx(max(p["gb_per_s"] for p in bw["probes"].values()))


def test_time_budget_skips_cleanly(model_path):
    cfg, params, _ = load_gguf(model_path, progress=False)
    updates = []
    r = run_bench((cfg, params), BenchSettings(prompt_len=PROMPT, gen=GEN, batches=BATCHES, steps_per_dispatch=STEPS,
                                               copy_bytes=1 << 20, time_budget_s=0.0),
                  progress=False, on_update=lambda x: updates.append(json.dumps(x)))
    assert r["status"] == "partial" and not r["errors"]
    assert len(r["skipped"]) == len(BATCHES) * (1 + len(STEPS))
    assert r["prefill"] == [] and r["decode"] == [] and r["summary"]["pp"] is None
    assert len(updates) >= 3  # written as it grows


def test_table_plot_and_missing_matplotlib(cli_run, result, monkeypatch, tmp_path):
    table = format_table(result)
    assert "B=2" in table and "roofline" in table and "prefill_and_sample 2 (expected 2)" in table
    png = cli_run[2] / "r.png"
    if "matplotlib" in sys.modules:
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="matplotlib"):
        plot(result, tmp_path / "x.png")
    from rjax.cli.main import main

    # asked for a plot without matplotlib: refused up front, before any measuring
    assert main(["bench", "-m", str(tmp_path / "absent.gguf"), "--plot", str(tmp_path / "x.png")]) == 2


def test_e2e_table_beside_llama_cpp(result):
    spec = importlib.util.spec_from_file_location("e2e", __import__("pathlib").Path(__file__).parents[2]
                                                  / "benchmarks" / "e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    row = e2e.compact_row("smollm2-135m", "q4_1", result, "ok")
    assert row["pp"] == result["summary"]["pp"] and row["tg"] == result["summary"]["tg"]
    assert row["tg_llama_cpp"] == 923 and row["tg_target"] == 1400
    partial = {k: v for k, v in result.items() if k != "summary"}  # a bench killed before the end
    assert e2e.compact_row("smollm2-135m", "q4_1", partial, "killed")["tg"] == summarize(result)["tg"]
    text = e2e.format_rows([row, e2e.compact_row("llama-8b", "q4_k", None, "skipped")])
    assert "54,603" in text and "3,356" in text and "skipped" in text



@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_kv_dtype_tma_stream_reads_every_block_of_its_rows(dtype):
    """The read floor's TMA stream (Mosaic GPU interpreter): each program walks its own run of
    rows through the ring, refilling slots (4 blocks in 2 slots), and reports the first rows of
    the last block that landed in slot 0: block 2 of its run, as the bytes of K (fp8 as int8)."""
    spec = importlib.util.spec_from_file_location("kv_dtype", __import__("pathlib").Path(__file__).parents[2]
                                                  / "benchmarks" / "kv_dtype.py")
    kv_dtype = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv_dtype)
    k = (jnp.arange(2 * 64 * 128).reshape(1, 2, 64, 128) % 97 - 48).astype(dtype)
    out = kv_dtype.tma_stream(k, -k, programs=4, block_rows=8, stages=2, interpret=True)
    rows = np.asarray(jax.lax.bitcast_convert_type(k, jnp.int8) if k.dtype.itemsize == 1 else k).reshape(128, 128)
    expect = np.stack([rows[p * 32 + 16:p * 32 + 24] for p in range(4)])
    np.testing.assert_array_equal(np.asarray(out), expect)
    with pytest.raises(ValueError, match="do not split into 3 programs"):
        kv_dtype.tma_stream(k, k, programs=3, interpret=True)


def test_speculative_bound_replays_prompt_lookup_and_prices_idle_rounds_as_plain_steps():
    """benchmarks/speculative.py's bound, by hand: prompt [5 1 2 3 4], reply [1 2 3 7 8], K = 4.
    Round 1: no earlier 4, nothing kept (idle), 1 emitted. Round 2: the 1 at position 1 drafts
    [2 3 4 1], 2 tokens kept plus the target's 7. Round 3: no earlier 7, idle, 8 emitted. At a
    verification of 2 steps: 5 tokens in 2 plain steps and 1 verification, 1.25x."""
    spec = importlib.util.spec_from_file_location("speculative", __import__("pathlib").Path(__file__).parents[2]
                                                  / "benchmarks" / "speculative.py")
    speculative = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speculative)
    assert speculative.lookup_rounds([5, 1, 2, 3, 4], [1, 2, 3, 7, 8], 4) == (5 / 3, 3, 2)
    assert speculative.bound_speedup(5, 3, 2, step_s=1.0, verify_s=2.0) == 1.25

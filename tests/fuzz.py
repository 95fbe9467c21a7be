"""Fuzzed model files: seeded mutations of tiny GGUF files and Hugging Face checkpoint
directories (header, tensors, config.json, tokenizer files, chat templates), each loaded through
`rjax.load` (config, params and tokenizer) and its chat template rendered over a conversation;
and fuzzed HTTP request bodies for the server (`http_body_case`, run by tests/test_server.py).

Every case must end in a correct load (and render) or in one `ModelFileError` (or, rendering,
`ChatTemplateError`) whose message names the file.
An uncaught exception, an error that does not name the file, a crash, a hang (a load over
TIMEOUT_S), an allocation the worker's address-space limit refuses, or a load whose params and
tokenizer disagree with its config is a failure.

    python -m tests.fuzz --cases 10000             # counts per outcome; exit status 1 on a failure
    python -m tests.fuzz --case 1234 --keep DIR    # one case again, its files kept under DIR
    python -m tests.fuzz --model FILE.gguf --cases 200   # byte-level damage to a real GGUF instead

Fixtures (written once per run, about 100 KB each): two GGUF files (llama: byte-level BPE
vocabulary with merges, dense and block-quantized tensors, untied head; gemma3: sentencepiece
vocabulary with scores, byte tokens and a chat template, tied head) and two Hugging Face
directories (qwen2: one model.safetensors of bf16/f16/f32 tensors; llama: two shards and an
index). Case i of seed s takes its fixture and mutations from Random(f"{s}:{i}"), so any case
can be run again on its own.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import rjax
from gguf_blocks import formats
from rjax.loaders import ModelFileError
from rjax.tokenizer import ChatTemplateError, chat_template
from rjax.synth import TensorSpec, random_tensor
from rjax.tokenizer import byte_alphabet

TIMEOUT_S = 10.0
MEMORY_LIMIT = 4 << 30  # address space a case may add: a load sized from an unchecked field hits it
OK = "loaded OK"

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] "
                  "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
                  "{% endif %}")
PROBE_TEXT = "Hello the world, <|im_end|> <end_of_turn> \u00fcn\u00ef 12  ok"
PROBE_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROBE_TEXT},
                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
# Chat templates as a hostile model file might carry them: syntax errors, sandbox escapes, values
# and output past the size limits, deep recursion, failures at one message. (A render that runs
# past its time is tested on its own: here it would cost seconds a case.)
HOSTILE_TEMPLATES = [
    "{% for m in messages %}{{ m['content'] }", "{% if %}", "{{ messages }", "{% endfor %}", "{% raw %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ cycler.__init__.__globals__.os }}",
    "{{ messages.append(1) }}", "{{ 'a' * 10 ** 10 }}", "{{ ('x' * 1000000) | replace('x', 'yyyyyyyyyy') }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "{{ 'a' | center(10 ** 9) }}",
    "{{ '%1000000000d' % 1 }}", "{{ '{:>1000000000}'.format(1) }}", "{{ (['x' * 1000000] * 1000) | join }}",
    "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "{{ undefined_thing.attr }}", "{{ messages[99] }}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% endif %}{% endfor %}",
    "{{ messages[0].content + 1 }}", "{{ 10 ** 10 ** 10 }}", "{{" + "(" * 3000 + "1" + ")" * 3000 + "}}",
    "{{ strftime_now('%Y') }}{{ messages | tojson }}", "", "\u00e9\ud800", CHATML[:-7],
]


def hostile_template(rng: random.Random) -> str:
    """One of HOSTILE_TEMPLATES, or a working template with characters cut or inserted."""
    if rng.random() < 0.6:
        return rng.choice(HOSTILE_TEMPLATES)
    text = list(rng.choice([CHATML, GEMMA_TEMPLATE]))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text))
        if rng.random() < 0.5:
            del text[at:at + rng.randint(1, 6)]
        else:
            text.insert(at, rng.choice(["{", "}", "%", "{{", "{%", "'", "(", "|", "~", "*", "endfor", " if "]))
    return "".join(text)


class CaseTimeout(BaseException):
    """Raised in a case that runs past its time; a BaseException so no loader can swallow it."""


# --- fixtures ------------------------------------------------------------------------------------


@dataclasses.dataclass
class GGUFSpec:
    """What a GGUF file holds, in write order: key -> (value, type, item type), and tensors as
    (name, logical (out, in) shape, GGML type, the raw bytes written)."""

    arch: str
    kvs: dict
    tensors: list


def _byte_level_vocab() -> tuple[list[str], list[str], list[str]]:
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n", "r e", "l l", "o r"]
    tokens = list(byte_alphabet().values()) + [m.replace(" ", "") for m in merges]
    return tokens, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], merges


def _tensor(name, shape, qtype, kind, index):
    data = random_tensor(TensorSpec(name, tuple(shape), qtype, kind), seed=7, index=index)
    return [name, tuple(shape), qtype, np.ascontiguousarray(data).reshape(-1).view(np.uint8)]


def _layer_tensors(i, types, d, q, kv, ff, extra=()):
    tq, tk, tv, to, tg, tu, td = types
    b = f"blk.{i}."
    out = [(b + "attn_norm.weight", (d,), Q.F32, "norm"), (b + "attn_q.weight", (q, d), tq, "matrix"),
           (b + "attn_k.weight", (kv, d), tk, "matrix"), (b + "attn_v.weight", (kv, d), tv, "matrix"),
           (b + "attn_output.weight", (d, q), to, "matrix"), (b + "ffn_norm.weight", (d,), Q.F32, "norm"),
           (b + "ffn_gate.weight", (ff, d), tg, "matrix"), (b + "ffn_up.weight", (ff, d), tu, "matrix"),
           (b + "ffn_down.weight", (d, ff), td, "matrix")]
    return out + [(b + name, shape, Q.F32, "norm") for name, shape in extra]


def llama_gguf_spec() -> GGUFSpec:
    tokens, specials, merges = _byte_level_vocab()
    eot, im_end = len(tokens), len(tokens) + 2
    d, ff, heads, kv_heads, hd, rows = 64, 256, 4, 2, 16, 272
    kvs = {
        "general.architecture": ("llama", V.STRING, None),
        "general.name": ("fuzz llama", V.STRING, None),
        "general.alignment": (32, V.UINT32, None),
        "llama.block_count": (2, V.UINT32, None),
        "llama.context_length": (128, V.UINT32, None),
        "llama.embedding_length": (d, V.UINT32, None),
        "llama.feed_forward_length": (ff, V.UINT32, None),
        "llama.attention.head_count": (heads, V.UINT32, None),
        "llama.attention.head_count_kv": (kv_heads, V.UINT32, None),
        "llama.rope.freq_base": (10000.0, V.FLOAT32, None),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32, None),
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.pre": ("smollm", V.STRING, None),
        "tokenizer.ggml.tokens": (tokens + specials, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1] * len(tokens) + [3] * len(specials), V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (merges, V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (eot, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (im_end, V.UINT32, None),
        "tokenizer.ggml.padding_token_id": (eot, V.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL, None),
        "tokenizer.chat_template": (CHATML, V.STRING, None),
    }
    layer_types = [(Q.F16, Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.Q5_1, Q.Q4_K),
                   (Q.BF16, Q.F32, Q.IQ4_NL, Q.Q8_0, Q.Q8_0, Q.F16, Q.Q6_K)]
    plan = [("token_embd.weight", (rows, d), Q.Q8_0, "matrix")]
    for i, types in enumerate(layer_types):
        plan += _layer_tensors(i, types, d, heads * hd, kv_heads * hd, ff)
    plan += [("output_norm.weight", (d,), Q.F32, "norm"), ("output.weight", (rows, d), Q.Q5_1, "matrix")]
    return GGUFSpec("llama", kvs, [_tensor(*t, index=i) for i, t in enumerate(plan)])


def gemma_gguf_spec() -> GGUFSpec:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "in", "er", "▁a", "  "]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(pieces)
    d, ff, heads, kv_heads, hd = 64, 256, 4, 1, 16
    kvs = {
        "general.architecture": ("gemma3", V.STRING, None),
        "gemma3.block_count": (2, V.UINT32, None),
        "gemma3.context_length": (256, V.UINT32, None),
        "gemma3.embedding_length": (d, V.UINT32, None),
        "gemma3.feed_forward_length": (ff, V.UINT32, None),
        "gemma3.attention.head_count": (heads, V.UINT32, None),
        "gemma3.attention.head_count_kv": (kv_heads, V.UINT32, None),
        "gemma3.attention.key_length": (hd, V.UINT32, None),
        "gemma3.attention.value_length": (hd, V.UINT32, None),
        "gemma3.rope.freq_base": (1e6, V.FLOAT32, None),
        "gemma3.rope.scaling.type": ("linear", V.STRING, None),
        "gemma3.rope.scaling.factor": (8.0, V.FLOAT32, None),
        "gemma3.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32, None),
        "gemma3.attention.sliding_window": (32, V.UINT32, None),
        "gemma3.attention.sliding_window_pattern": (2, V.UINT32, None),
        "gemma3.vocab_size": (len(tokens), V.UINT32, None),
        "tokenizer.ggml.model": ("llama", V.STRING, None),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": ([-float(i) for i in range(len(tokens))], V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.bos_token_id": (2, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (1, V.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (3, V.UINT32, None),
        "tokenizer.ggml.padding_token_id": (0, V.UINT32, None),
        "tokenizer.ggml.add_bos_token": (True, V.BOOL, None),
        "tokenizer.ggml.add_eos_token": (False, V.BOOL, None),
        "tokenizer.ggml.add_space_prefix": (False, V.BOOL, None),
        "tokenizer.chat_template": (GEMMA_TEMPLATE, V.STRING, None),
    }
    extra = [("attn_q_norm.weight", (hd,)), ("attn_k_norm.weight", (hd,)), ("post_attention_norm.weight", (d,)),
             ("post_ffw_norm.weight", (d,))]
    layer_types = [(Q.F16, Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.Q5_0, Q.BF16, Q.Q3_K),
                   (Q.Q8_0, Q.F32, Q.Q8_0, Q.Q5_1, Q.Q8_0, Q.Q4_0, Q.Q5_K)]
    plan = [("token_embd.weight", (len(tokens), d), Q.Q8_0, "matrix")]
    for i, ts in enumerate(layer_types):
        plan += _layer_tensors(i, ts, d, heads * hd, kv_heads * hd, ff, extra)
    plan += [("output_norm.weight", (d,), Q.F32, "norm")]
    return GGUFSpec("gemma3", kvs, [_tensor(*t, index=i) for i, t in enumerate(plan)])


def write_gguf(spec: GGUFSpec, path: Path) -> Path:
    """The spec as a GGUF file, through gguf's writer (which writes whatever types it is given)."""
    w = GGUFWriter(path, spec.arch)
    w.kv_data[0].clear()  # the spec says whether (and how) general.architecture is there
    try:
        for key, (value, vtype, sub) in spec.kvs.items():
            w.add_key_value(key, value, vtype, sub)
        for name, shape, qtype, data in spec.tensors:
            w.add_tensor_info(name, shape, np.dtype(np.float32), data.nbytes, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, _, _, data in spec.tensors:
            w.write_tensor_data(data)
    finally:
        w.close()
    return path


def _write_hf_tokenizer(directory: Path) -> None:
    tokens, specials, merges = _byte_level_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(directory / "tokenizer.json"))
    eot, im_end = len(tokens), len(tokens) + 2
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
         "chat_template": CHATML}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))


def _hf_tensors(cfg: dict, dtypes: dict, prefix="model.") -> dict[str, np.ndarray]:
    """Random tensors for a Hugging Face llama/qwen2 config; `dtypes` maps a name fragment to a dtype."""
    rng = np.random.default_rng(5)
    d, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {prefix + "embed_tokens.weight": (cfg["vocab_size"], d), prefix + "norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"{prefix}layers.{i}."
        shapes.update({b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
                       b + "self_attn.q_proj.weight": (q, d), b + "self_attn.k_proj.weight": (kv, d),
                       b + "self_attn.v_proj.weight": (kv, d), b + "self_attn.o_proj.weight": (d, q),
                       b + "mlp.gate_proj.weight": (ff, d), b + "mlp.up_proj.weight": (ff, d),
                       b + "mlp.down_proj.weight": (d, ff)})
        if cfg["model_type"] == "qwen2":
            shapes.update({b + "self_attn.q_proj.bias": (q,), b + "self_attn.k_proj.bias": (kv,),
                           b + "self_attn.v_proj.bias": (kv,)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], d)
    names = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
    out = {}
    for name, shape in shapes.items():
        kind = next((v for k, v in dtypes.items() if k in name), "f32")
        out[name] = (rng.standard_normal(shape) * 0.05 + (1.0 if "norm" in name else 0.0)).astype(names[kind])
    return out


def write_hf_qwen2(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 272, "tie_word_embeddings": False,
           "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 128, "max_window_layers": 2,
           "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = _hf_tensors(cfg, {"embed": "bf16", "q_proj.weight": "bf16", "k_proj.weight": "f16", "mlp.up": "bf16",
                                "mlp.down": "f16", "lm_head": "f16"})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _write_hf_tokenizer(directory)
    return directory


def write_hf_llama_sharded(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 128},
           "vocab_size": 272, "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 256}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = _hf_tensors(cfg, {"embed": "f16", "self_attn": "bf16", "mlp": "f16"})
    shards = {"model-00001-of-00002.safetensors": [n for n in tensors if "layers.1." not in n and "norm.w" not in n]}
    shards["model-00002-of-00002.safetensors"] = [n for n in tensors if n not in shards[
        "model-00001-of-00002.safetensors"]]
    weight_map = {}
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, directory / file)
        weight_map.update({n: file for n in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, indent=2))
    _write_hf_tokenizer(directory)
    return directory


# --- interesting values ---------------------------------------------------------------------------

def _u64_values(orig: int, size: int) -> list[int]:
    return [0, 1, 2, 3, 4, 7, 8, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40,
            1 << 48, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, orig - 1, orig + 1, orig * 2, orig + size, size]


def _u32_values(orig: int) -> list[int]:
    return [0, 1, 2, 3, 4, 7, 8, 12, 13, 29, 30, 31, 35, 39, 255, 0xFFFF, 0x10000, (1 << 31) - 1, 1 << 31,
            (1 << 32) - 1, orig - 1, orig + 1]


def _pick_int(rng: random.Random, orig: int, nbytes: int, size: int) -> int:
    if rng.random() < 0.1:
        return rng.getrandbits(8 * nbytes)
    values = _u64_values(orig, size) if nbytes == 8 else _u32_values(orig)
    return rng.choice(values) % (1 << (8 * nbytes))


BAD_UTF8 = [b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80"]

# --- byte-level GGUF mutations, placed by the reader's own parse of the pristine file ------------


@dataclasses.dataclass
class Part:
    offset: int
    nbytes: int
    kind: str  # what it is: "key_len", "key", "type", "value", "str_len", "str", "itype", "count", ...


@dataclasses.dataclass
class GGUFLayout:
    keys: list           # metadata keys, in file order
    kvs: list            # per key: list[Part]
    infos: list          # per tensor info: list[Part]
    data_offset: int
    tensors: list        # (name, qtype, data offset, n_bytes)


def gguf_layout(path: Path) -> GGUFLayout:
    reader = GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]

    def where(part):
        return part.__array_interface__["data"][0] - base

    kvs = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        parts = [Part(where(field.parts[0]), 8, "key_len"), Part(where(field.parts[1]), field.parts[1].nbytes, "key"),
                 Part(where(field.parts[2]), 4, "type")]
        rest = field.parts[3:]
        if field.types[0] == V.ARRAY:
            parts += [Part(where(rest[0]), 4, "itype"), Part(where(rest[1]), 8, "count")]
            item = field.types[-1] if len(field.types) > 1 else None
            for p in rest[2:]:
                kind = "item_len" if item == V.STRING and p.nbytes == 8 and p.dtype == np.uint64 else "item"
                parts.append(Part(where(p), p.nbytes, kind))
        elif field.types[0] == V.STRING:
            parts += [Part(where(rest[0]), 8, "str_len"), Part(where(rest[1]), rest[1].nbytes, "str")]
        else:
            parts.append(Part(where(rest[0]), rest[0].nbytes, "value"))
        kvs.append(parts)
    infos = []
    for t in reader.tensors:
        name_len, name, n_dims, dims, dtype, offset = t.field.parts
        infos.append([Part(where(name_len), 8, "name_len"), Part(where(name), name.nbytes, "name"),
                      Part(where(n_dims), 4, "n_dims")]
                     + [Part(where(dims) + 8 * j, 8, "dim") for j in range(len(dims))]
                     + [Part(where(dtype), 4, "ggml_type"), Part(where(offset), 8, "offset")])
    tensors = [(t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    return GGUFLayout(keys, kvs, infos, int(reader.data_offset), tensors)


def _put_int(buf: bytearray, part: Part, value: int) -> None:
    buf[part.offset:part.offset + part.nbytes] = (value % (1 << (8 * part.nbytes))).to_bytes(part.nbytes, "little")


def _get_int(buf: bytearray, part: Part) -> int:
    return int.from_bytes(buf[part.offset:part.offset + part.nbytes], "little")


def _mutate_part(rng, buf: bytearray, part: Part) -> str:
    """One field of the header given a new value chosen for its kind."""
    if part.kind in ("key", "str", "name") or (part.kind == "item" and part.nbytes > 8):
        if not part.nbytes:
            return f"empty {part.kind} left"
        at = part.offset + rng.randrange(part.nbytes)
        bad = rng.choice(BAD_UTF8 + [bytes([rng.randrange(256)]), b".", b"\x00", b" "])
        bad = bad[:part.offset + part.nbytes - at]
        buf[at:at + len(bad)] = bad
        return f"{part.kind} bytes at {at} = {bad!r}"
    if part.nbytes in (4, 8) and part.kind != "item":
        value = _pick_int(rng, _get_int(buf, part), part.nbytes, len(buf))
        _put_int(buf, part, value)
        return f"{part.kind} at {part.offset} = {value}"
    # a scalar value or a numeric array item: raw bytes, or a NaN / Inf / extreme of its width
    raw = {1: [b"\x00", b"\xff", b"\x02", b"\x80"], 2: [b"\x00\x7c", b"\x00\xfe", b"\xff\xff"],
           4: [struct.pack("<f", math.nan), struct.pack("<f", math.inf), struct.pack("<f", -1.0),
               struct.pack("<i", -1), struct.pack("<i", 0), struct.pack("<I", 1 << 31)],
           8: [struct.pack("<d", math.nan), struct.pack("<q", -1), struct.pack("<Q", 1 << 63)]}.get(part.nbytes, [])
    value = rng.choice(raw) if raw and rng.random() < 0.7 else bytes(rng.randrange(256) for _ in range(part.nbytes))
    buf[part.offset:part.offset + part.nbytes] = value
    return f"{part.kind} at {part.offset} = {value.hex()}"


BYTE_KINDS = {"header": 6, "kv": 30, "tensor_info": 20, "truncate": 12, "flip": 10, "poison": 12, "splice": 6}
# Mutations that move or cut what follows them: applied after the ones placed by the pristine layout.
LATE_KINDS = ("truncate", "splice")


def gguf_byte_mutation(rng: random.Random, buf: bytearray, layout: GGUFLayout, kind: str) -> str:
    header_end = layout.data_offset
    if kind == "header":
        part = rng.choice([Part(4, 4, "version"), Part(8, 8, "tensor_count"), Part(16, 8, "kv_count"),
                           Part(0, 4, "magic")])
        if part.kind == "magic":
            buf[rng.randrange(4)] ^= 1 << rng.randrange(8)
            return "magic bit flipped"
        return "header " + _mutate_part(rng, buf, part)
    if kind == "kv":
        i = rng.randrange(len(layout.kvs))
        key, parts = layout.keys[i], layout.kvs[i]
        # the count, item type and items of the big arrays matter most
        weights = [1 if p.kind in ("item", "item_len") else 8 for p in parts]
        return f"kv {key}: " + _mutate_part(rng, buf, rng.choices(parts, weights)[0])
    if kind == "tensor_info":
        i = rng.randrange(len(layout.infos))
        return f"tensor info {layout.tensors[i][0]}: " + _mutate_part(rng, buf, rng.choice(layout.infos[i]))
    if kind == "truncate":
        cut = rng.randrange(header_end) if rng.random() < 0.6 else rng.randrange(len(buf))
        del buf[cut:]
        return f"truncated at {cut} of {header_end} header bytes"
    if kind == "flip":
        n = rng.choice([1, 1, 2, 4, 16])
        spots = [rng.randrange(header_end) if rng.random() < 0.7 else rng.randrange(len(buf)) for _ in range(n)]
        for at in spots:
            buf[at] ^= 1 << rng.randrange(8)
        return f"{n} bit flips at {spots[:4]}"
    if kind == "poison":
        return _poison_gguf(rng, buf, layout)
    at = rng.randrange(24, header_end)
    if rng.random() < 0.5:
        n = rng.choice([1, 4, 8])
        del buf[at:at + n]
        return f"{n} header bytes deleted at {at}"
    n = rng.choice([1, 4, 8])
    buf[at:at] = bytes(rng.randrange(256) for _ in range(n))
    return f"{n} bytes inserted at {at}"


def _poison_gguf(rng, buf, layout) -> str:
    """A NaN or Inf in a dense tensor's values or in a block-quantized tensor's float16 scales."""
    name, qtype, start, n_bytes = rng.choice(layout.tensors)
    qtype = Q(qtype)
    special = rng.choice(["nan", "inf", "-inf"])
    if qtype in formats.DENSE_TYPES:
        size = np.dtype(formats.DENSE_TYPES[qtype]).itemsize
        at = start + size * rng.randrange(n_bytes // size)
        value = np.array(float(special), formats.DENSE_TYPES[qtype]).tobytes()
    else:
        fields, off = [], 0
        for f in formats.LAYOUTS[qtype][1]:
            if f.dtype == np.float16:
                fields.append(off)
            off += np.dtype(f.dtype).itemsize * math.prod(f.shape)
        type_size = GGML_QUANT_SIZES[qtype][1]
        at = start + type_size * rng.randrange(n_bytes // type_size) + rng.choice(fields)
        value = np.array(float(special), np.float16).tobytes()
    buf[at:at + len(value)] = value
    return f"tensor {name} ({qtype.name}): {special} written at {at}"


# --- GGUF mutations that rewrite the file from an edited spec ------------------------------------

def _value_pool() -> list[tuple]:
    return [("12", V.STRING, None), (b"\xff\xfe", V.STRING, None), ("", V.STRING, None), (12, V.UINT32, None),
            (0, V.UINT32, None), (-1, V.INT32, None), ((1 << 32) - 1, V.UINT32, None), ((1 << 64) - 1, V.UINT64, None),
            (1 << 40, V.UINT64, None), (-(1 << 63), V.INT64, None), (12.5, V.FLOAT32, None),
            (math.nan, V.FLOAT32, None),
            (math.inf, V.FLOAT32, None), (-2.0, V.FLOAT64, None), (1e300, V.FLOAT64, None), (True, V.BOOL, None),
            (False, V.BOOL, None), ([1, 2], V.ARRAY, V.INT32), (["a", "b"], V.ARRAY, V.STRING),
            ([7], V.ARRAY, V.UINT8), ([1.5], V.ARRAY, V.FLOAT32), (300, V.UINT16, None), (-3, V.INT8, None)]


def _optional_keys(arch: str, spec: GGUFSpec) -> list[tuple[str, tuple]]:
    """Keys the loaders read when present, with values to try."""
    tokens = spec.kvs.get("tokenizer.ggml.tokens", ([],))[0]  # an earlier edit may have retyped it
    n_tokens = len(tokens) if isinstance(tokens, (list, tuple)) else 0
    return [
        (f"{arch}.rope.scaling.type", value) for value in [("yarn", V.STRING, None), ("llama3", V.STRING, None),
                                                           ("none", V.STRING, None), (3, V.UINT32, None)]
    ] + [
        (f"{arch}.rope.scaling.factor", (0.0, V.FLOAT32, None)),
        (f"{arch}.rope.scaling.factor", (math.nan, V.FLOAT32, None)),
        (f"{arch}.rope.scaling.low_freq_factor", (1.0, V.FLOAT32, None)),
        (f"{arch}.rope.scaling.original_context_length", (1 << 40, V.UINT64, None)),
        (f"{arch}.attention.sliding_window", (0, V.UINT32, None)),
        (f"{arch}.attention.sliding_window", (-5, V.INT32, None)),
        (f"{arch}.attention.sliding_window", ((1 << 32) - 1, V.UINT32, None)),
        (f"{arch}.attention.sliding_window_pattern", ([True, False], V.ARRAY, V.BOOL)),
        (f"{arch}.attention.sliding_window_pattern", ([True, False, True], V.ARRAY, V.BOOL)),
        (f"{arch}.attention.sliding_window_pattern", (0, V.UINT32, None)),
        (f"{arch}.attention.key_length", (0, V.UINT32, None)),
        (f"{arch}.attention.key_length", (7, V.UINT32, None)),
        (f"{arch}.attention.head_count_kv", ([2, 2], V.ARRAY, V.UINT32)),
        (f"{arch}.feed_forward_length", ([256, 256], V.ARRAY, V.UINT32)),
        (f"{arch}.vocab_size", (n_tokens + 1, V.UINT32, None)),
        (f"{arch}.vocab_size", (0, V.UINT32, None)),
        (f"{arch}.rope.freq_base_swa", (-1.0, V.FLOAT32, None)),
        ("general.alignment", (0, V.UINT32, None)), ("general.alignment", (48, V.UINT32, None)),
        ("general.alignment", (64, V.UINT64, None)),
        ("tokenizer.ggml.add_space_prefix", ("yes", V.STRING, None)),
        ("tokenizer.ggml.eot_token_id", ((1 << 32) - 1, V.UINT32, None)),
        ("tokenizer.ggml.eom_token_id", ("x", V.STRING, None)),
        ("tokenizer.ggml.unknown_token_id", (n_tokens + 5, V.UINT32, None)),
        ("tokenizer.ggml.add_eos_token", (2, V.UINT8, None)),
        ("tokenizer.ggml.scores", ([0.0] * n_tokens if n_tokens else [0.0], V.ARRAY, V.FLOAT32)),
        ("tokenizer.ggml.merges", (["a b"], V.ARRAY, V.STRING)),
        ("tokenizer.chat_template", ("{% for %}", V.STRING, None)),
        ("tokenizer.chat_template", (["x"], V.ARRAY, V.STRING)),
        ("tokenizer.ggml.pre", ("not-a-pre", V.STRING, None)),
        ("tokenizer.ggml.model", ("bert", V.STRING, None)),
        ("tokenizer.ggml.model", ("llama", V.STRING, None)),
        ("tokenizer.ggml.model", ("gpt2", V.STRING, None)),
        ("general.architecture", ("qwen2", V.STRING, None)),
        ("general.architecture", ("gemma3", V.STRING, None)),
        ("general.architecture", ("llama", V.STRING, None)),
        ("general.architecture", ("mamba", V.STRING, None)),
    ]


def _edit_array(rng, key, value, vtype, sub) -> tuple[tuple, str]:
    """A plausible damage to a tokenizer array: shorter, longer, duplicates, bad entries."""
    items = list(value)
    n = len(items)
    how = rng.choice(["shorten", "lengthen", "duplicate", "bad_item", "shuffle", "empty_item"])
    if how == "shorten":
        items = items[:rng.choice([1, n // 2, n - 1])] or items[:1]
    elif how == "lengthen":
        items = items + items[:rng.choice([1, 5, n])]
    elif how == "duplicate":
        items[rng.randrange(n)] = items[rng.randrange(n)]
    elif how == "shuffle":
        rng.shuffle(items)
    elif sub == V.STRING:
        j = rng.randrange(n)
        items[j] = (rng.choice([b"\xff", b"abc\xc3", "zz qq", "nospace", " ", "a  b", "\x00"])
                    if how == "bad_item" else "")
    elif sub in (V.INT32, V.UINT32):
        items[rng.randrange(n)] = rng.choice([0, 7, 99, -1 if sub == V.INT32 else (1 << 32) - 1])
    else:
        items[rng.randrange(n)] = rng.choice([math.nan, math.inf, -1e30])
    return (items, vtype, sub), f"{key}: {how}"


def gguf_spec_mutation(rng: random.Random, spec: GGUFSpec) -> str:
    """Edit the spec in place (its lists and dicts are the caller's copy)."""
    kind = rng.choices(["drop_kv", "retype_kv", "array", "add_kv", "drop_tensor", "rename_tensor", "reshape_tensor",
                        "retype_tensor", "extra_tensor", "chat_template"], [10, 16, 14, 16, 6, 8, 10, 10, 5, 8])[0]
    keys = list(spec.kvs)
    if kind == "chat_template":
        template = hostile_template(rng)
        try:
            template.encode("utf-8")
        except UnicodeEncodeError:
            template = template.encode("utf-8", "surrogatepass")  # bytes that are not UTF-8
        spec.kvs["tokenizer.chat_template"] = (template, V.STRING, None)
        return f"tokenizer.chat_template = {template!r:.60}"
    if kind == "drop_kv":
        key = rng.choice(keys)
        del spec.kvs[key]
        return f"drop key {key}"
    if kind == "retype_kv":
        key = rng.choice(keys)
        spec.kvs[key] = rng.choice(_value_pool())
        return f"key {key} = {spec.kvs[key][0]!r:.40} ({spec.kvs[key][1].name})"
    if kind == "array":
        arrays = [k for k in keys if spec.kvs[k][1] == V.ARRAY]
        key = rng.choice(arrays)
        spec.kvs[key], what = _edit_array(rng, key, *spec.kvs[key])
        return what
    if kind == "add_kv":
        key, value = rng.choice(_optional_keys(spec.arch, spec))
        spec.kvs[key] = value
        return f"set {key} = {value[0]!r:.40} ({value[1].name})"
    i = rng.randrange(len(spec.tensors))
    name, shape, qtype, data = spec.tensors[i]
    if kind == "drop_tensor":
        del spec.tensors[i]
        return f"drop tensor {name}"
    if kind == "rename_tensor":
        new = rng.choice(["blk.7.attn_q.weight", "blk.x.attn_q.weight", "blk.-1.ffn_up.weight", "blk.0.attn_q",
                          "blk..weight", "blk", "token_embd", "foo.weight", "blk.0.attn_q.bias",
                          "blk.99999999999999999999.ffn_up.weight", "output.weight", "rope_freqs.weight",
                          "\u00e9\u00e9.weight"])
        if any(t[0] == new for t in spec.tensors):
            new += ".dup"
        spec.tensors[i] = [new, shape, qtype, data]
        return f"rename tensor {name} -> {new}"
    if kind == "reshape_tensor":
        options = [shape[::-1], shape[:-1] or (1,), (*shape, 1), (1, *shape), (0, *shape[1:]),
                   (shape[0] + 1, *shape[1:]), (*shape[:-1], shape[-1] + 32), (shape[0] * 2, *shape[1:]),
                   (*shape[:-1], 1 << 40), (1 << 33, 1 << 33), (2, 2, 2, 2, 2)]
        new = tuple(rng.choice(options))
        spec.tensors[i] = [name, new, qtype, data]
        return f"tensor {name} shape {shape} -> {new}"
    if kind == "retype_tensor":
        new = rng.choice([Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.I32, Q.F64, Q.I8, Q.IQ2_XXS,
                          Q.TQ1_0, Q.Q8_K, Q.MXFP4])
        regenerate = rng.random() < 0.5
        if regenerate:  # a valid tensor of the new type, when its rows allow it
            if shape[-1] % GGML_QUANT_SIZES[new][0] == 0 and new in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K,
                                                                      Q.Q6_K):
                data = _tensor(name, shape, new, "norm" if len(shape) == 1 and new == Q.F32 else "matrix", i)[3]
            else:
                regenerate = False
        spec.tensors[i] = [name, shape, new, data]
        return f"tensor {name} type {Q(qtype).name} -> {new.name}" + (" (new data)" if regenerate else "")
    # an extra tensor: llama.cpp's rope frequency factors, of a right or wrong size, or an unused one
    n = rng.choice([8, 7, 1, 100])
    values = rng.choice([np.ones(n, np.float32), np.full(n, np.nan, np.float32), np.zeros(n, np.float32)])
    new_name = rng.choice(["rope_freqs.weight", "blk.0.unused.weight", "blk.5.attn_norm.weight"])
    if any(t[0] == new_name for t in spec.tensors):
        return f"extra tensor {new_name} already there"
    spec.tensors.append([new_name, (n,), Q.F32, values.view(np.uint8)])
    return f"extra tensor {new_name} ({n} values, first {values[0]})"


# --- Hugging Face directory mutations ---------------------------------------------------------------

CONFIG_VALUES = [None, True, False, 0, 1, -1, 2, 3, 7, 64, 10 ** 6, 1 << 31, 1 << 63, 10 ** 30, 0.5, 64.0, -1e-6,
                 1e308, math.nan, math.inf, -math.inf, "", "64", "silu", [], [64], [1, 2], {},
                 {"rope_type": "llama3"}, {"rope_type": "linear", "factor": "x"}, {"rope_type": "default"},
                 ["sliding_attention", "full_attention"], ["full_attention"] * 2, "gelu_pytorch_tanh"]
CONFIG_KEYS_OPTIONAL = ["head_dim", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                        "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias", "mlp_bias",
                        "final_logit_softcapping", "text_config", "model_type", "eos_token_id", "bos_token_id",
                        "query_pre_attn_scalar", "sliding_window_pattern"]


def _json_object(path: Path) -> dict | None:
    """The file's JSON object, or None if an earlier step already broke it."""
    try:
        value = json.loads(path.read_bytes())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _mutate_config(rng, directory: Path) -> str:
    path = directory / "config.json"
    cfg = _json_object(path)
    if cfg is None or rng.random() < 0.15:
        return _mutate_raw_json(rng, path)
    key = rng.choice(list(cfg) + CONFIG_KEYS_OPTIONAL)
    target = cfg
    if isinstance(cfg.get(key), dict) and cfg[key] and rng.random() < 0.5:  # inside rope_scaling
        target, key = cfg[key], rng.choice(list(cfg[key]))
    if rng.random() < 0.2:
        target.pop(key, None)
        what = f"config.json: drop {key}"
    else:
        target[key] = copy.deepcopy(rng.choice(CONFIG_VALUES))
        what = f"config.json: {key} = {target[key]!r:.40}"
    path.write_text(json.dumps(cfg))
    return what


def _mutate_raw_json(rng, path: Path) -> str:
    data = bytearray(path.read_bytes())
    how = rng.choice(["truncate", "flip", "bad_utf8", "replace"]) if data else "replace"
    if how == "truncate":
        del data[rng.randrange(len(data)):]
    elif how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "bad_utf8":
        at = rng.randrange(len(data))
        data[at:at] = rng.choice(BAD_UTF8)
    else:
        data = bytearray(rng.choice([b"[]", b"null", b"{}", b"\xef\xbb\xbf{}", b"", b"{\"model_type\": 5}"]))
    path.write_bytes(bytes(data))
    return f"{path.name}: raw {how}"


def _split_safetensors(data: bytes) -> tuple[dict, bytes] | None:
    n = int.from_bytes(data[:8], "little")
    try:
        return json.loads(data[8:8 + n]), data[8 + n:]
    except ValueError:
        return None


def _join_safetensors(header: dict, body: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


ST_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "F4", "E8M0",
             "C64", "X", 5, None, ""]


def _mutate_safetensors(rng, directory: Path) -> str:
    files = sorted(directory.glob("*.safetensors"))
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    split = _split_safetensors(bytes(data))
    if split is None or not isinstance(split[0], dict) or not any(n != "__metadata__" for n in split[0]):
        return _mutate_raw_json(rng, path) + " (header already damaged)"
    header, body = split
    names = [n for n in header if n != "__metadata__"]
    kind = rng.choices(["dtype", "shape", "offsets", "drop", "rename", "add", "metadata", "length", "truncate",
                        "flip_header", "poison"], [10, 12, 12, 5, 6, 4, 4, 8, 8, 8, 10])[0]
    name = rng.choice(names)
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = rng.choice(ST_DTYPES)
        what = f"dtype {entry['dtype']!r}"
    elif kind == "shape":
        shape = list(entry["shape"])
        entry["shape"] = rng.choice([shape[::-1], shape[:-1], shape + [1], [0] + shape[1:], [shape[0] + 1] + shape[1:],
                                     [-1] + shape[1:], [1 << 40] * len(shape), [1 << 63, 2], ["4"] + shape[1:],
                                     [4.0] + shape[1:], [], None, [1 << 32, 1 << 32]])
        what = f"shape {shape} -> {entry['shape']}"
    elif kind == "offsets":
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, a], [a, b + 2], [a + 2, b + 2], [a, len(body) + 8], [a, 1 << 62],
                                            [-1, b], [a], [a, b, b], [0, b - a], "0,4", [a, (1 << 64) - 1]])
        what = f"data_offsets {[a, b]} -> {entry['data_offsets']}"
    elif kind == "drop":
        del header[name]
        what = "dropped"
    elif kind == "rename":
        new = rng.choice(["model.layers.9.mlp.up_proj.weight", "model.layers.x.foo", "lm_head.weight",
                          "model.layers.0.self_attn.o_proj.bias", "", "model.norm", "model.embed_tokens.weight",
                          "model.layers.1.self_attn.q_proj.weight", "vision_tower.x"])
        header[new] = header.pop(name)
        what = f"renamed -> {new!r}"
    elif kind == "add":
        header["model.extra.weight"] = dict(entry)
        what = "added a second entry over the same bytes"
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([{"format": "pt"}, {"x": 5}, [], "x", None, {"format": ["pt"]}])
        what = f"__metadata__ = {header['__metadata__']!r}"
    elif kind == "length":
        value = _pick_int(rng, int.from_bytes(data[:8], "little"), 8, len(data))
        data[:8] = value.to_bytes(8, "little")
        path.write_bytes(bytes(data))
        return f"{path.name}: header length = {value}"
    elif kind == "truncate":
        n = int.from_bytes(data[:8], "little") + 8
        cut = rng.randrange(n) if rng.random() < 0.5 else rng.randrange(len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"{path.name}: truncated at {cut} (header ends at {n})"
    elif kind == "flip_header":
        n = int.from_bytes(data[:8], "little") + 8
        at = rng.randrange(8, n)
        data[at] = rng.choice([ord('"'), ord("{"), ord("]"), 0xff, ord("9"), ord(","), data[at] ^ 1])
        path.write_bytes(bytes(data))
        return f"{path.name}: header byte {at} changed"
    else:  # poison: a NaN or Inf among a float tensor's values
        floats = [n for n in names if header[n]["dtype"] in ("F32", "F16", "BF16")]
        name = rng.choice(floats)
        entry = header[name]
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[entry["dtype"]]
        a, b = entry["data_offsets"]
        size = np.dtype(dtype).itemsize
        at = a + size * rng.randrange((b - a) // size)
        special = rng.choice(["nan", "inf", "-inf"])
        body = bytearray(body)
        body[at:at + size] = np.array(float(special), dtype).tobytes()
        what = f"{special} at value {(at - a) // size}"
    path.write_bytes(_join_safetensors(header, bytes(body)))
    return f"{path.name}: tensor {name}: {what}"


def _mutate_index(rng, directory: Path) -> str:
    path = directory / "model.safetensors.index.json"
    index = _json_object(path)
    if index is None or not isinstance(index.get("weight_map"), dict) or not index["weight_map"] or rng.random() < 0.3:
        return _mutate_raw_json(rng, path)
    how = rng.choice(["entry", "drop_entry", "weight_map", "metadata"])
    if how == "entry":
        name = rng.choice(list(index["weight_map"]))
        index["weight_map"][name] = rng.choice(["missing.safetensors", 5, None, "../config.json", "config.json",
                                                "model-00001-of-00002.safetensors", "", "/etc/hostname", []])
        what = f"weight_map[{name}] = {index['weight_map'][name]!r}"
    elif how == "drop_entry":
        index["weight_map"].pop(rng.choice(list(index["weight_map"])))
        what = "a weight_map entry dropped"
    elif how == "weight_map":
        index["weight_map"] = rng.choice([[], "x", None, {}, 5])
        what = f"weight_map = {index['weight_map']!r}"
    else:
        index["metadata"] = rng.choice([None, [], {"total_size": -1}, "x"])
        what = f"metadata = {index['metadata']!r}"
    path.write_text(json.dumps(index))
    return f"index: {what}"


def _mutate_tokenizer_files(rng, directory: Path) -> str:
    which = rng.choice(["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
    path = directory / which
    cfg = _json_object(path)
    if which == "tokenizer.json" or cfg is None or rng.random() < 0.3:
        return _mutate_raw_json(rng, path)
    key = rng.choice(list(cfg) + ["bos_token", "add_eos_token", "chat_template", "eos_token_id"])
    cfg[key] = copy.deepcopy(rng.choice(CONFIG_VALUES + [{"content": 5}, [{"name": 1}], "<|im_end|>",
                                                         "{% for %}", [{"name": "default", "template": 5}]]))
    path.write_text(json.dumps(cfg))
    return f"{which}: {key} = {cfg[key]!r:.40}"


def _mutate_chat_template(rng, directory: Path) -> str:
    template = hostile_template(rng)
    if rng.random() < 0.5:
        (directory / "chat_template.jinja").write_bytes(template.encode("utf-8", "surrogatepass"))
        return f"chat_template.jinja = {template!r:.60}"
    path = directory / "tokenizer_config.json"
    cfg = _json_object(path) or {}
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg))
    return f"tokenizer_config.json: chat_template = {template!r:.60}"


def hf_mutation(rng: random.Random, directory: Path) -> str:
    options = [(_mutate_config, 40), (_mutate_safetensors, 45), (_mutate_tokenizer_files, 8),
               (_mutate_chat_template, 8)]
    if (directory / "model.safetensors.index.json").exists():
        options.append((_mutate_index, 8))
    fn = rng.choices([f for f, _ in options], [w for _, w in options])[0]
    return fn(rng, directory)


# --- fixtures on disk, and one case ---------------------------------------------------------------


@dataclasses.dataclass
class Fixture:
    name: str
    path: Path
    spec: GGUFSpec | None = None
    layout: GGUFLayout | None = None
    data: bytes = b""


GGUF_SPECS = {"llama.gguf": llama_gguf_spec, "gemma3.gguf": gemma_gguf_spec}


def make_fixtures(root: Path) -> list[Fixture]:
    root.mkdir(parents=True, exist_ok=True)
    for name, make in GGUF_SPECS.items():
        write_gguf(make(), root / name)
    write_hf_qwen2(root / "qwen2-hf")
    write_hf_llama_sharded(root / "llama-hf-sharded")
    return load_fixtures(root)


def load_fixtures(root: Path, model: Path | None = None) -> list[Fixture]:
    """The fixtures `make_fixtures(root)` wrote (GGUF specs rebuilt: they are deterministic); or,
    with `model`, that one GGUF file alone, mutated byte by byte."""
    if model is not None:
        return [Fixture(model.name, model, None, gguf_layout(model), model.read_bytes())]
    out = []
    for name, make in GGUF_SPECS.items():
        path = root / name
        out.append(Fixture(name, path, make(), gguf_layout(path), path.read_bytes()))
    return out + [Fixture("qwen2-hf", root / "qwen2-hf"), Fixture("llama-hf-sharded", root / "llama-hf-sharded")]


def make_case(rng: random.Random, fixture: Fixture, where: Path) -> tuple[Path, list[str]]:
    """A damaged copy of `fixture` under `where` -> (path to load, what was done)."""
    n = rng.choices([1, 2, 3], [70, 20, 10])[0]
    steps = []
    if fixture.layout is not None:
        path = where / fixture.name
        if fixture.spec is not None and rng.random() < 0.4:  # semantic edits, written again by gguf's writer
            spec = GGUFSpec(fixture.spec.arch, dict(fixture.spec.kvs), [list(t) for t in fixture.spec.tensors])
            for _ in range(n):
                steps.append(gguf_spec_mutation(rng, spec))
            try:
                write_gguf(spec, path)
            except (ValueError, TypeError, struct.error, OverflowError) as e:  # the writer refused the edit
                steps.append(f"(writer refused: {type(e).__name__}; pristine file used)")
                path.write_bytes(fixture.data)
            return path, steps
        buf = bytearray(fixture.data)
        kinds = rng.choices(list(BYTE_KINDS), list(BYTE_KINDS.values()), k=n)
        for kind in sorted(kinds, key=lambda k: k in LATE_KINDS):
            steps.append(gguf_byte_mutation(rng, buf, fixture.layout, kind))
        path.write_bytes(bytes(buf))
        return path, steps
    path = where / fixture.name
    shutil.copytree(fixture.path, path)
    for _ in range(n):
        steps.append(hf_mutation(rng, path))
    return path, steps


def _fields(params):
    yield "embed", params.embed
    yield "final_norm", params.final_norm
    if params.lm_head is not None:
        yield "lm_head", params.lm_head
    for i, layer in enumerate(params.layers):
        for f in dataclasses.fields(layer):
            w = getattr(layer, f.name)
            if w is not None:
                yield f"layers[{i}].{f.name}", w


def check_loaded(model) -> str | None:
    """What is inconsistent in a loaded model (None: nothing): shapes against the config, NaN/Inf,
    and a tokenizer whose ids fit the embedding."""
    cfg, params = model.config, model.params
    if len(params.layers) != cfg.n_layers:
        return f"{len(params.layers)} layers for n_layers {cfg.n_layers}"
    q, kv, d, ff = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model, cfg.d_ff
    want = {"embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "wq": (q, d), "wk": (kv, d),
            "wv": (kv, d), "wo": (d, q), "w_gate": (ff, d), "w_up": (ff, d), "w_down": (d, ff), "bq": (q,),
            "bk": (kv,), "bv": (kv,), "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    for name, w in _fields(params):
        field = name.rsplit(".", 1)[-1]
        shape = tuple(w.shape)
        if shape != want.get(field, (d,)):
            return f"{name} has shape {shape}, config implies {want.get(field, (d,))}"
        arrays = [np.asarray(p) for p in (w.planes if hasattr(w, "planes") else (w,))]
        for a in arrays:
            if (a.dtype.kind == "f" or a.dtype.name == "bfloat16") and not np.isfinite(a.astype(np.float32)).all():
                return f"{name} holds NaN or Inf"
    if cfg.n_heads % cfg.n_kv_heads or min(cfg.n_layers, d, ff, cfg.n_heads, cfg.head_dim, cfg.vocab_size) < 1:
        return f"config out of range: {cfg}"
    tok = model.tokenizer
    ids = tok.encode(PROBE_TEXT)
    if any(not 0 <= i < cfg.vocab_size for i in ids):
        return f"tokenizer gives ids outside the embedding's {cfg.vocab_size} rows: {max(ids)}"
    if not isinstance(tok.decode(ids), str):
        return "decode did not return text"
    if tok.chat_template is not None:  # a template that fails raises ChatTemplateError naming it
        text = tok.apply_chat_template(PROBE_MESSAGES)
        if not isinstance(text, str) or len(text) > chat_template.MAX_RENDER_CHARS:
            return f"the chat template rendered {type(text).__name__} of {len(text):,} characters"
    return None


def _message_class(message: str, where: Path) -> str:
    """A message with its file, quoted names, lists and numbers blanked: one line per kind of error."""
    text = message.replace(str(where), "<file>")
    text = re.sub(r"<file>[^\s:,]*", "<file>", text)
    text = re.sub(r"b?'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\[[^\[\]]*\]|\{[^{}]*\}", "[…]", text)
    text = re.sub(r"(?<![\w.])(0x[0-9a-fA-F]+|-?\d[\d,_]*(\.\d+)?(e[+-]?\d+)?|-?inf|nan)(?![\w.])", "N", text)
    text = re.sub(r"\bblk\.\d+\.", "blk.N.", text)
    return text[:100]


def _outcome_of_error(e: BaseException, where: Path) -> str:
    message = str(e)
    if isinstance(e, (ModelFileError, ChatTemplateError)):
        kind = "ChatTemplateError" if isinstance(e, ChatTemplateError) else "ModelFileError"  # subclasses too
        if str(where) not in message:
            return f"FAIL {kind} not naming the file: {_message_class(message, where)}"
        return f"{kind}: {_message_class(message, where)}"
    return f"FAIL uncaught {type(e).__module__}.{type(e).__name__}: {_message_class(message, where)}"


def _on_alarm(signum, frame):
    raise CaseTimeout()


def run_case(seed: int, index: int, fixtures: list[Fixture], work: Path, timeout: float = TIMEOUT_S,
             keep: bool = False) -> tuple[str, list[str], float]:
    """Make and load case `index`: (outcome, what was done, seconds)."""
    rng = random.Random(f"{seed}:{index}")
    fixture = fixtures[rng.randrange(len(fixtures))]
    where = work / f"case-{index}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    path, steps = make_case(rng, fixture, where)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            model = rjax.load(path, progress=False)
            problem = check_loaded(model)
            outcome = OK if problem is None else f"FAIL inconsistent load: {_message_class(problem, where)}"
            del model
        except CaseTimeout:
            outcome = f"FAIL hang (over {timeout:g} s)"
        except Exception as e:  # noqa: BLE001 - the point: anything not a ModelFileError is a failure
            outcome = _outcome_of_error(e, where)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CaseTimeout:  # the alarm landed between the handlers above
        outcome = f"FAIL hang (over {timeout:g} s)"
    finally:
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    if not keep:
        shutil.rmtree(where, ignore_errors=True)
    return outcome, [f"{fixture.name}: {s}" for s in steps], elapsed


def limit_memory(extra: int = MEMORY_LIMIT) -> tuple[int, int]:
    """Cap this process's address space at its current size + `extra`; -> the old limits."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + extra
    if old[1] != resource.RLIM_INFINITY:
        cap = min(cap, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, old[1]))
    return old


# --- the long run: worker processes, each case under a watchdog ------------------------------------

def _worker(conn, seed: int, fixture_root: str, work: str, timeout: float, model: str | None) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging

    logging.disable(logging.WARNING)  # the gguf writer's duplicate-key warnings
    fixtures = load_fixtures(Path(fixture_root), Path(model) if model else None)
    limit_memory()
    conn.send(("ready", None))
    while True:
        index = conn.recv()
        if index is None:
            return
        try:
            outcome, steps, elapsed = run_case(seed, index, fixtures, Path(work), timeout)
        except MemoryError:
            outcome, steps, elapsed = "FAIL uncaught MemoryError (address-space limit)", [], 0.0
        except Exception as e:  # noqa: BLE001 - a bug in making the case, not in loading it
            outcome, steps, elapsed = f"FAIL harness error {type(e).__name__}: {e}", [], 0.0
        conn.send((index, (outcome, steps, elapsed)))


def run_many(cases: range, seed: int, workers: int, timeout: float, root: Path, model: Path | None = None,
             report_every: float = 60.0):
    """Run `cases` in `workers` processes; a case over `timeout` (or a worker that dies) is killed
    and recorded, and a fresh worker takes over. -> (Counter of outcomes, failures, times)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    if model is None:
        make_fixtures(root / "fixtures")
    ctx = mp.get_context("spawn")
    counts, failures, times = collections.Counter(), [], []
    pending = list(reversed(cases))
    # slow start-up (imports) is not a case's time: the watchdog starts at the first send
    busy: dict = {}
    procs = []

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, seed, str(root / "fixtures"), str(root / "work"), timeout,
                                              str(model) if model else None), daemon=True)
        p.start()
        child.close()
        if parent.poll(120) and parent.recv()[0] == "ready":
            procs.append((p, parent))
            return p, parent
        p.kill()
        raise RuntimeError("a fuzz worker did not start")

    def feed(p, conn):
        if pending:
            index = pending.pop()
            conn.send(index)
            busy[conn] = (p, index, time.monotonic())

    for _ in range(workers):
        feed(*start())
    done, last_report, t0 = 0, time.monotonic(), time.monotonic()
    while busy:
        ready = wait(list(busy), timeout=1.0)
        for conn in ready:
            p, index, _ = busy.pop(conn)
            try:
                got_index, (outcome, steps, elapsed) = conn.recv()
            except (EOFError, OSError):
                p.join(5)
                outcome, steps, elapsed = f"FAIL crash (worker exit code {p.exitcode})", [], 0.0
                counts[outcome] += 1
                failures.append((index, outcome, steps))
                done += 1
                feed(*start())
                continue
            counts[outcome] += 1
            times.append((elapsed, index))
            if outcome.startswith("FAIL"):
                failures.append((index, outcome, steps))
            done += 1
            feed(p, conn)
        now = time.monotonic()
        for conn, (p, index, since) in list(busy.items()):
            if now - since > timeout + 5:  # the in-process alarm did not fire: a hang in native code
                p.kill()
                p.join(5)
                busy.pop(conn)
                outcome = f"FAIL hang (over {timeout:g} s, killed)"
                counts[outcome] += 1
                failures.append((index, outcome, []))
                done += 1
                feed(*start())
        if now - last_report > report_every:
            last_report = now
            rate = done / (now - t0)
            print(f"  {done}/{len(cases)} cases, {rate:.1f}/s, failures so far: {len(failures)}", flush=True)
    for p, conn in procs:
        if p.is_alive():
            try:
                conn.send(None)
            except OSError:
                pass
            p.join(5)
    return counts, failures, times


def print_report(counts, failures, times, total: int, seconds: float, top: int = 60) -> None:
    print(f"\n{total} cases in {seconds:.0f} s")
    errors = [(k, n) for k, n in counts.most_common() if k.startswith(("ModelFileError", "ChatTemplateError"))]
    fails = sum(n for k, n in counts.items() if k.startswith("FAIL"))
    print(f"  {counts.get(OK, 0):6d}  {OK}")
    print(f"  {sum(n for _, n in errors):6d}  ModelFileError (at load) or ChatTemplateError (rendering a conversation) "
          f"naming the file, in {len(errors)} message classes:")
    for k, n in errors[:top]:
        print(f"      {n:6d}  {k}")
    if len(errors) > top:
        print(f"      {sum(n for _, n in errors[top:]):6d}  in the {len(errors) - top} other classes")
    print(f"  {fails:6d}  failures (uncaught exceptions, unnamed files, hangs, crashes, inconsistent loads)")
    for k, n in counts.most_common():
        if k.startswith("FAIL"):
            print(f"      {n:6d}  {k}")
    if times:
        ts = sorted(times)
        print(f"  case time: median {ts[len(ts) // 2][0] * 1e3:.0f} ms, max {ts[-1][0]:.2f} s (case {ts[-1][1]})")
    for index, outcome, steps in failures[:20]:
        print(f"  case {index}: {outcome}\n      " + "\n      ".join(steps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--first", type=int, default=0, help="index of the first case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds after which a load counts as a hang")
    ap.add_argument("--case", type=int, default=None, help="run this one case in this process and print it")
    ap.add_argument("--keep", default=None, help="directory to keep the fixtures and cases in")
    ap.add_argument("--top", type=int, default=60, help="message classes to list (the rest are summed)")
    ap.add_argument("--model", default=None, help="fuzz this GGUF file (byte-level mutations) instead of the fixtures")
    a = ap.parse_args(argv)
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="rjax-fuzz-"))
    try:
        model = Path(a.model).resolve() if a.model else None
        if a.case is not None:
            fixtures = load_fixtures(root, model) if model else make_fixtures(root / "fixtures")
            outcome, steps, elapsed = run_case(a.seed, a.case, fixtures, root / "work", a.timeout, keep=bool(a.keep))
            print(f"case {a.case}: {outcome} ({elapsed:.2f} s)\n  " + "\n  ".join(steps))
            return 1 if outcome.startswith("FAIL") else 0
        t0 = time.monotonic()
        cases = range(a.first, a.first + a.cases)
        counts, failures, times = run_many(cases, a.seed, a.workers, a.timeout, root, model)
        print_report(counts, failures, times, len(cases), time.monotonic() - t0, a.top)
        return 1 if failures else 0
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())


# --- HTTP request bodies ---------------------------------------------------------------------------
# Bodies for the server's /v1/completions and /v1/chat/completions: a valid request with fields set
# to values of the wrong type, range or encoding, unknown fields, broken messages, or the raw bytes
# damaged. Every one must get a 200 (a stream without an error event) or a 4xx with an OpenAI
# error body; run by tests/test_server.py against a server on a tiny model.

def _deep(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


HTTP_VALUES = [None, True, False, 0, 1, -1, 2, 4, 17, 2 ** 31, 2 ** 63, 2 ** 100, -2 ** 100, 0.5, -0.0, 1e308,
               float("nan"), float("inf"), "", "x", "yes", "0", "a\ud800b", "a\x00b", "x" * 300, "\U0001f642" * 5,
               [], [1], [0, 1, 2], ["a"] * 5, ["a"] * 100, [""], [[1, 2]], [[]], [None], {}, {"a": 1},
               {"type": "text"}, _deep(40)]
HTTP_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
               "stream", "stream_options", "logprobs", "top_logprobs", "echo", "ignore_eos", "user", "best_of",
               "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools",
               "tool_choice", "max_completion_tokens", "metadata", "frobnicate"]
HTTP_MESSAGES = [{"role": "user"}, {"role": "wizard", "content": "hi"}, {"content": "hi"},
                 {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
                 {"role": "user", "content": [{"type": "text", "text": 5}]}, {"role": "assistant", "content": None},
                 {"role": "user", "content": "hi", "name": "n" * 300}, {"role": "tool", "content": "x"},
                 {"role": "user", "content": "a\ud800"}, {"role": "user", "content": "hi", "extra": 1}, "hi", None]


def http_body_case(rng: random.Random, model: str) -> tuple[str, bytes, str]:
    """One fuzzed request: (path, body bytes, what was done)."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": rng.choice([1, 2, 4])}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "The quick brown fox"])}]
    else:
        body["prompt"] = rng.choice(["hello", "The quick", [1, 2, 3], ["a", "b"]])
    if rng.random() < 0.3:
        body.update(rng.choice([{"stream": True}, {"temperature": 0.7, "seed": 3}, {"stop": ["e", "o"]},
                                {"n": 2}, {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2},
                                {"stream": True, "stream_options": {"include_usage": True}}]))
    steps = []
    for _ in range(rng.choices([1, 2, 3], [60, 30, 10])[0]):
        kind = rng.choices(["field", "drop", "message", "raw"], [70, 8, 12 if chat else 0, 10])[0]
        if kind == "field":
            key = rng.choice(HTTP_FIELDS)
            body[key] = copy.deepcopy(rng.choice(HTTP_VALUES))
            steps.append(f"{key} = {body[key]!r:.40}")
        elif kind == "drop" and body:
            key = rng.choice(sorted(body))
            del body[key]
            steps.append(f"drop {key}")
        elif kind == "message":
            messages = body.get("messages") if isinstance(body.get("messages"), list) else []
            messages.insert(rng.randint(0, len(messages)), copy.deepcopy(rng.choice(HTTP_MESSAGES)))
            body["messages"] = messages
            steps.append(f"message {messages!r:.60}")
    raw = json.dumps(body).encode()  # json escapes: a lone surrogate goes as "\ud800", NaN as NaN
    if rng.random() < 0.1:
        cut = rng.choice(["truncate", "bad utf-8", "not an object", "empty", "nested 100,000 deep"])
        deep = b"[" * 100_000 + b"]" * 100_000  # written out: json.dumps would recurse out of stack
        raw = {"truncate": raw[:rng.randrange(max(1, len(raw)))], "bad utf-8": raw.replace(b'"', b'"\xff', 1),
               "not an object": json.dumps([body]).encode(), "empty": b"",
               "nested 100,000 deep": raw[:-1] + b', "metadata": ' + deep + b"}"}[cut]
        steps.append(cut)
    return path, raw, "; ".join(steps) or "valid"


def http_outcome(status: int, content_type: str, text: str) -> str:
    """A response's outcome class: '200', '<status> <param or code>', or 'FAIL ...'."""
    if status == 200:
        if "text/event-stream" in content_type:
            events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return "FAIL stream without [DONE]"
            if any('"error"' in e[:12] for e in events[:-1]):
                return f"FAIL error event in a 200 stream: {events[-2][:120]}"
            return "200 stream"
        return "200"
    try:
        error = json.loads(text)["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["message"]
    except Exception:  # noqa: BLE001
        return f"FAIL {status} without an OpenAI error body: {text[:120]}"
    if not 400 <= status < 500:
        return f"FAIL {status}: {error['message'][:120]}"
    return f"{status} {error['param'] or error['code']}"

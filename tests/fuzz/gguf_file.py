"""Fuzzed GGUF files: the fixtures' specs (llama and gemma3, every block type) written by gguf's
writer, byte-level mutations placed by the reader's own parse of the pristine file, and semantic
edits of the spec written again."""
from __future__ import annotations

import dataclasses
import math
import random
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from gguf_blocks import formats
from rjax.loading.synth import TensorSpec, random_tensor
from tests.fuzz.common import BAD_UTF8, CHATML, GEMMA_TEMPLATE, byte_level_vocab, hostile_template, pick_int


@dataclasses.dataclass
class GGUFSpec:
    """What a GGUF file holds, in write order: key -> (value, type, item type), and tensors as
    (name, logical (out, in) shape, GGML type, the raw bytes written)."""

    arch: str
    kvs: dict
    tensors: list


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
    tokens, specials, merges = byte_level_vocab()
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


def put_int(buf: bytearray, part: Part, value: int) -> None:
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
        value = pick_int(rng, _get_int(buf, part), part.nbytes, len(buf))
        put_int(buf, part, value)
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


def damage(rng: random.Random, n: int, spec: GGUFSpec | None, layout: GGUFLayout, data: bytes, path: Path) -> list[str]:
    """Write to `path` the pristine file `data` (of `spec`, parsed as `layout`) with `n` mutations:
    semantic edits of a copy of the spec, written again by gguf's writer, or bytes changed in
    place. -> what was done."""
    steps = []
    if spec is not None and rng.random() < 0.4:
        spec = GGUFSpec(spec.arch, dict(spec.kvs), [list(t) for t in spec.tensors])
        for _ in range(n):
            steps.append(gguf_spec_mutation(rng, spec))
        try:
            write_gguf(spec, path)
        except (ValueError, TypeError, struct.error, OverflowError) as e:  # the writer refused the edit
            steps.append(f"(writer refused: {type(e).__name__}; pristine file used)")
            path.write_bytes(data)
        return steps
    buf = bytearray(data)
    kinds = rng.choices(list(BYTE_KINDS), list(BYTE_KINDS.values()), k=n)
    for kind in sorted(kinds, key=lambda k: k in LATE_KINDS):
        steps.append(gguf_byte_mutation(rng, buf, layout, kind))
    path.write_bytes(bytes(buf))
    return steps

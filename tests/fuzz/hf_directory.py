"""Fuzzed Hugging Face checkpoint directories: the fixtures (qwen2 in one model.safetensors,
llama in two shards with an index) and mutations of config.json, the safetensors headers and
values, the index, the tokenizer files and the chat template."""
from __future__ import annotations

import copy
import json
import math
import random
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tests.fuzz.common import BAD_UTF8, CHATML, byte_level_vocab, hostile_template, pick_int


def _write_hf_tokenizer(directory: Path) -> None:
    tokens, specials, merges = byte_level_vocab()
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


def split_safetensors(data: bytes) -> tuple[dict, bytes] | None:
    n = int.from_bytes(data[:8], "little")
    try:
        return json.loads(data[8:8 + n]), data[8 + n:]
    except ValueError:
        return None


def join_safetensors(header: dict, body: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


ST_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "F4", "E8M0",
             "C64", "X", 5, None, ""]


def _mutate_safetensors(rng, directory: Path) -> str:
    files = sorted(directory.glob("*.safetensors"))
    path = rng.choice(files)
    data = bytearray(path.read_bytes())
    split = split_safetensors(bytes(data))
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
        value = pick_int(rng, int.from_bytes(data[:8], "little"), 8, len(data))
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
    path.write_bytes(join_safetensors(header, bytes(body)))
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


def damage(rng: random.Random, n: int, source: Path, path: Path) -> list[str]:
    """A copy of the directory `source` at `path` with `n` mutations -> what was done."""
    shutil.copytree(source, path)
    return [hf_mutation(rng, path) for _ in range(n)]

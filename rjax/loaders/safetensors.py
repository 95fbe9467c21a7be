"""Hugging Face checkpoint directory (config.json + safetensors) -> (ModelConfig, Params).

The directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Files are memory-mapped through `safetensors.safe_open` and read
one tensor at a time: each tensor is copied to the device (optionally quantized first) and its
host copy dropped, so host memory stays near the size of the final params. Matrices keep their
(out, in) orientation and their file dtype (bf16 stays bf16); 1-D norms and biases become float32.

What differs from a GGUF of the same model is settled here, so the forward pass is shared:
Hugging Face checkpoints rotate rope "halves" for every architecture, and Gemma stores its norm
weights without the +1 its RMSNorm adds (x * (1 + w)), which is added at load.
"""
from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16" dtype, which safe_open needs for BF16
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from rjax.config import ModelConfig, RopeScaling
from rjax.loaders.errors import (MAX_CONTEXT, MAX_DIM, MAX_LAYERS, MAX_VOCAB, ModelFileError, check_finite,
                                 expected_shape)
from rjax.model import LayerParams, Params
from gguf_blocks.qtensor import QTensor

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma3_text", "gemma3")
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}

# transformers' defaults for the keys a config.json may leave out, per model_type
_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu"),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=10000.0,
                    tie_word_embeddings=False, hidden_act="silu", sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu", sliding_window=4096,
                  use_sliding_window=False, max_window_layers=28),
    "gemma3_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, tie_word_embeddings=True,
                        hidden_activation="gelu_pytorch_tanh", head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=4096),
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_DENSE_DTYPES = ("BF16", "F16", "F32")

# Layer tensor names (under `layers.N.`) -> LayerParams fields. Llama-style models have one norm
# before the MLP, which Hugging Face calls post_attention_layernorm; Gemma 3 has four norms.
_LAYER_COMMON = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}
_LAYER_LLAMA = {**_LAYER_COMMON, "post_attention_layernorm.weight": "ffn_norm"}
_LAYER_GEMMA = {**_LAYER_COMMON, "post_attention_layernorm.weight": "post_attn_norm",
                "pre_feedforward_layernorm.weight": "ffn_norm",
                "post_feedforward_layernorm.weight": "post_ffn_norm"}
_TOP = {"embed_tokens.weight": "embed", "norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_NORMS = {"attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "final_norm"}
_BIASES = {"bq", "bk", "bv"}
# Where the text model's tensors live: plain causal LMs, and Gemma 3's multimodal checkpoints as
# transformers >= 4.52 saves them and as they were published before.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
# Tensors of a multimodal checkpoint that a text-only forward pass does not use.
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved

QUANTIZE_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")
# Weights whose rows do not split into the requested type's blocks get this type instead
# (llama.cpp's choice for Q4_K); a row length that splits into no 32-blocks stays dense.
_QUANTIZE_FALLBACK = {QType.Q4_K: QType.Q5_0}

# Host memory bounds while loading: a tensor is read this many bytes of rows at a time, and a
# file's memory map is re-opened after this many bytes (see _FileReader).
_CHUNK_BYTES = 64 << 20
_REMAP_BYTES = 64 << 20
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
             "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


# --- config ------------------------------------------------------------------------------------


def read_hf_config(path: str | os.PathLike) -> tuple[str, dict]:
    """(model_type, the text model's config dict) from `path/config.json`.

    Gemma 3 multimodal configs (model_type "gemma3") keep the language model in `text_config`;
    it is returned merged with the top-level keys it inherits, as model_type "gemma3_text".
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelFileError(f"{path} is not a directory: a Hugging Face checkpoint is a directory "
                             f"with {CONFIG_FILE} and safetensors weights")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelFileError(f"{path}: no {CONFIG_FILE}: a Hugging Face checkpoint needs one beside its weights")
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{config_path}: not valid JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ModelFileError(f"{config_path}: expected a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(f"{config_path}: unsupported model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ModelFileError(f"{config_path}: model_type 'gemma3' needs a 'text_config' object")
        text = dict(text)
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise ModelFileError(f"{config_path}: text_config.model_type {text['model_type']!r} is not 'gemma3_text'")
        if "tie_word_embeddings" in hf:
            text.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
        model_type, hf = "gemma3_text", text
    return model_type, hf


class _Keys:
    """Typed access to config keys, with transformers' defaults and errors that name the key."""

    def __init__(self, hf: dict, model_type: str, where: Path):
        self.hf, self.defaults, self.where = hf, _DEFAULTS[model_type], where

    def get(self, key, default=None):
        value = self.hf.get(key)
        return self.defaults.get(key, default) if value is None else value

    def window(self) -> int | None:
        """sliding_window: an explicit null means none, an absent key transformers' default."""
        if "sliding_window" in self.hf and self.hf["sliding_window"] is None:
            return None
        return self.int("sliding_window", maximum=MAX_CONTEXT)

    def int(self, key, default=None, minimum: int = 1, maximum: int = MAX_DIM) -> int:
        value = self.get(key, default)
        if value is None:
            raise ModelFileError(f"{self.where}: missing config key {key!r}")
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not number or value != int(value) or value < minimum:
            raise ModelFileError(f"{self.where}: config key {key!r} = {value!r:.80} is not an integer >= {minimum}")
        if value > maximum:
            raise ModelFileError(f"{self.where}: config key {key!r} = {value!r} is more than {maximum:,}, "
                                 "the most this loader accepts")
        return int(value)

    def float(self, key, default=None) -> float:
        value = self.get(key, default)
        return _positive(self, key, value)

    def bool(self, key) -> bool:
        value = self.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelFileError(f"{self.where}: config key {key!r} = {value!r:.80} is not true or false")
        return bool(value)

    def str(self, key) -> str | None:
        value = self.get(key)
        if value is not None and not isinstance(value, str):
            raise ModelFileError(f"{self.where}: config key {key!r} = {value!r:.80} is not a string")
        return value

    def fail(self, message: str):
        raise ModelFileError(f"{self.where}: {message}")


def _positive(keys: _Keys, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        keys.fail(f"config key {key!r} = {value!r:.80} is not a positive number")
    return float(value)


def _rope(keys: _Keys, params: dict, theta_default: float, context: int, allowed: tuple[str, ...]):
    """One rope parameter dict -> (theta, RopeScaling | None, linear factor)."""
    if not isinstance(params, dict):
        keys.fail(f"rope parameters must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _positive(keys, "rope_theta", params.get("rope_theta") or theta_default)
    if not isinstance(kind, str) or kind not in allowed:
        keys.fail(f"rope type {kind!r:.80} is not supported here; supported: {', '.join(allowed)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        keys.fail(f"partial_rotary_factor {params['partial_rotary_factor']!r:.80} is not supported (only 1)")

    def number(name):
        if name not in params:
            keys.fail(f"{kind} rope scaling lacks {name!r}")
        return _positive(keys, f"rope {name}", params[name])

    if kind == "linear":
        return theta, None, number("factor")
    if kind == "llama3":
        original = params.get("original_max_position_embeddings") or context
        if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= MAX_CONTEXT:
            keys.fail(f"rope original_max_position_embeddings = {original!r:.80} is not an integer in "
                      f"[1, {MAX_CONTEXT:,}]")
        return theta, RopeScaling(number("factor"), number("low_freq_factor"), number("high_freq_factor"),
                                  original), 1.0
    return theta, None, 1.0


def _layer_types(keys: _Keys, n_layers: int, default: list[str]) -> list[str]:
    types = keys.hf.get("layer_types") or default
    if (not isinstance(types, list) or len(types) != n_layers
            or not all(t in ("sliding_attention", "full_attention") for t in types)):
        keys.fail(f"layer_types must list 'sliding_attention' / 'full_attention' for each of the {n_layers} "
                  f"layers, got {types!r:.120}")
    return types


def config_from_hf(model_type: str, hf: dict, where: str | os.PathLike = CONFIG_FILE) -> ModelConfig:
    """A Hugging Face config (as `read_hf_config` returns it) -> ModelConfig."""
    keys = _Keys(hf, model_type, Path(where))
    d_model = keys.int("hidden_size")
    n_layers = keys.int("num_hidden_layers", maximum=MAX_LAYERS)
    n_heads = keys.int("num_attention_heads")
    n_kv = keys.int("num_key_value_heads", n_heads)
    head_dim = keys.int("head_dim", d_model // n_heads)
    if head_dim % 2:  # rope rotates pairs of values
        keys.fail(f"the head size {head_dim} (head_dim, or hidden_size / num_attention_heads) is odd; "
                  "rope needs an even one")
    context = keys.int("max_position_embeddings", maximum=MAX_CONTEXT)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            keys.fail(f"{key} = {hf[key]!r} is not supported (only null)")
    if hf.get("use_bidirectional_attention"):
        keys.fail("use_bidirectional_attention is not supported")
    if hf.get("mlp_bias"):
        keys.fail("mlp_bias is not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        keys.fail("attention_bias (biases on q/k/v/o projections) is not supported for "
                  f"model_type {model_type!r}")
    act_key = "hidden_activation" if model_type == "gemma3_text" else "hidden_act"
    activation = _ACTIVATIONS.get(keys.str(act_key))
    if activation is None:
        keys.fail(f"{act_key} {keys.get(act_key)!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    common = dict(arch=_ARCH[model_type], n_layers=n_layers, d_model=d_model, d_ff=keys.int("intermediate_size"),
                  n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                  vocab_size=keys.int("vocab_size", maximum=MAX_VOCAB),
                  context_length=context, rms_eps=keys.float("rms_norm_eps"), rope_pairing="halves",
                  activation=activation, tie_embeddings=keys.bool("tie_word_embeddings"))
    if n_heads % n_kv:
        keys.fail(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")

    try:
        return _arch_config(keys, model_type, hf, common, n_layers, d_model, context)
    except ValueError as e:  # ModelConfig's own consistency checks
        if isinstance(e, ModelFileError):
            raise
        keys.fail(str(e))


def _object(keys: _Keys, key: str) -> dict:
    """A config value that must be an object (or absent/null: empty)."""
    value = keys.hf.get(key) or {}
    if not isinstance(value, dict):
        keys.fail(f"config key {key!r} = {value!r:.80} is not an object")
    return value


def _arch_config(keys: _Keys, model_type: str, hf: dict, common: dict, n_layers: int, d_model: int,
                 context: int) -> ModelConfig:
    if model_type == "gemma3_text":
        rp = _object(keys, "rope_parameters")
        if "full_attention" in rp or "sliding_attention" in rp:  # transformers 5: one dict per layer type
            global_rp, local_rp = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        else:  # older configs: rope_theta + rope_scaling for global layers, rope_local_base_freq for local
            global_rp = {**_object(keys, "rope_scaling"), **rp}
            local_rp = {}
        g_theta, _, g_linear = _rope(keys, global_rp, keys.float("rope_theta"), context, ("default", "linear"))
        l_theta, _, l_linear = _rope(keys, local_rp, keys.float("rope_local_base_freq"), context, ("default", "linear"))
        # the pattern only matters without layer_types: every pattern-th layer is global
        pattern = keys.int("sliding_window_pattern", hf.get("_sliding_window_pattern") or 6, maximum=MAX_LAYERS)
        types = _layer_types(keys, n_layers, ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                              for i in range(n_layers)])
        window = keys.window()
        local = [t == "sliding_attention" for t in types]
        return ModelConfig(**common, rope_theta=g_theta, qk_norm=True, post_norms=True, embed_scale=math.sqrt(d_model),
                           attn_scale=keys.float("query_pre_attn_scalar") ** -0.5,
                           layer_windows=tuple(window if s else None for s in local),
                           layer_rope_theta=tuple(l_theta if s else g_theta for s in local),
                           layer_rope_linear=tuple(l_linear if s else g_linear for s in local))

    rp = _object(keys, "rope_parameters") or _object(keys, "rope_scaling")
    if hf.get("partial_rotary_factor") is not None:
        rp = {**rp, "partial_rotary_factor": hf["partial_rotary_factor"]}
    theta, scaling, linear = _rope(keys, rp, keys.float("rope_theta"), context, ("default", "linear", "llama3"))
    if model_type == "mistral":  # one window for every layer, when the config sets one
        windows = (keys.window(),) * n_layers
    elif model_type == "qwen2":  # windows only with use_sliding_window, on layers >= max_window_layers
        window = keys.window() if keys.get("use_sliding_window") else None
        first = keys.int("max_window_layers", minimum=0, maximum=MAX_LAYERS)
        types = _layer_types(keys, n_layers, ["sliding_attention" if window is not None and i >= first
                                              else "full_attention" for i in range(n_layers)])
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:  # llama has no sliding window
        windows = ()
    return ModelConfig(**common, rope_theta=theta, rope_scaling=scaling, layer_rope_linear=(linear,) * n_layers,
                       qkv_bias=model_type == "qwen2", layer_windows=windows)


def _config(path: Path) -> tuple[str, ModelConfig]:
    model_type, hf = read_hf_config(path)
    return model_type, config_from_hf(model_type, hf, path / CONFIG_FILE)


# --- weight files ------------------------------------------------------------------------------


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards its index names, or model.safetensors."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelFileError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from e
        # plain file names beside the index: an index does not reach outside its directory
        bad = [n for n in names if not isinstance(n, str) or not n or Path(n).name != n or n in (".", "..")]
        if bad:
            raise ModelFileError(f"{index}: weight_map names {bad[0]!r:.80}, not a file name in the directory")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelFileError(f"{index} lists weight files that are missing: {', '.join(missing)}")
        return [path / n for n in names]
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pth"))
    hint = f" (found {', '.join(others[:3])}: PyTorch pickles are not read; convert to safetensors)" if others else ""
    raise ModelFileError(f"{path}: no weights: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _open(file: Path):
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(f"{file}: cannot read the safetensors header ({e})") from e


def _headers(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every tensor of the files -> (file, dtype name, shape), read from the headers only
    (safetensors checks each header's offsets against its dtype, shape and the file's size)."""
    out = {}
    for file in files:
        with _open(file) as f:
            for name in f.offset_keys():
                info = f.get_slice(name)
                if name in out:
                    raise ModelFileError(f"{file}: tensor {name!r} is also in {out[name][0].name}")
                out[name] = (file, info.get_dtype(), tuple(int(s) for s in info.get_shape()))
    return out


def _canonical(name: str) -> str | None:
    """A file's tensor name -> the text model's name (`layers.N....`, `embed_tokens.weight`, `norm.weight`,
    `lm_head.weight`), or None for tensors that the text model does not use."""
    if name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
        return None
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _plan(cfg: ModelConfig, model_type: str, tensors: dict, where: Path) -> dict[str, tuple[int | None, str]]:
    """File tensor name -> (layer index or None, field) for every tensor the params need; errors
    name a missing tensor, an unknown one, or one whose shape disagrees with the config."""
    layer_map = _LAYER_GEMMA if model_type == "gemma3_text" else _LAYER_LLAMA
    plan: dict[str, tuple[int | None, str]] = {}
    unknown = []
    for name in tensors:
        local = _canonical(name)
        if local is None:
            continue
        parts = local.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit():
            i, field = int(parts[1]), layer_map.get(parts[2])
            if field is None or i >= cfg.n_layers:
                unknown.append(name)
                continue
            plan[name] = (i, field)
        elif local in _TOP:
            if local == "lm_head.weight" and cfg.tie_embeddings:
                continue  # tied: the head is the embedding, whatever the file also holds
            plan[name] = (None, _TOP[local])
        else:
            unknown.append(name)
    if unknown:
        raise ModelFileError(f"{where}: tensors the {model_type} forward pass has no place for: "
                             f"{', '.join(unknown[:6])}" + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else ""))

    required = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    required += ["bq", "bk", "bv"] if cfg.qkv_bias else []
    required += ["q_norm", "k_norm"] if cfg.qk_norm else []
    required += ["post_attn_norm", "post_ffn_norm"] if cfg.post_norms else []
    have = set(plan.values())
    inverse = {f: n for n, f in layer_map.items()}
    prefix = _prefix_of(tensors)
    missing = [f"{prefix}layers.{i}.{inverse[f]}" for i in range(cfg.n_layers) for f in required if (i, f) not in have]
    missing = [f"{prefix}embed_tokens.weight"] * ((None, "embed") not in have) + missing
    missing += [f"{prefix}norm.weight"] * ((None, "final_norm") not in have)
    missing += ["lm_head.weight (tie_word_embeddings is false)"] * (not cfg.tie_embeddings and (None, "lm_head") not in have)
    if missing:
        raise ModelFileError(f"{where}: missing tensors: {', '.join(missing[:6])}"
                             + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    for name, (_, field) in plan.items():
        file, dtype, shape = tensors[name]
        want = expected_shape(cfg, field)
        if shape != want:
            raise ModelFileError(f"{file}: tensor {name!r} has shape {list(shape)}, but config.json implies "
                                 f"{list(want)} (hidden_size {cfg.d_model}, heads {cfg.n_heads}/{cfg.n_kv_heads} "
                                 f"of {cfg.head_dim}, intermediate_size {cfg.d_ff}, vocab_size {cfg.vocab_size})")
        if dtype not in _DENSE_DTYPES:
            raise ModelFileError(f"{file}: tensor {name!r} has dtype {dtype}; supported: {', '.join(_DENSE_DTYPES)}")
    return plan


def _prefix_of(tensors: dict) -> str:
    """The text-model prefix the file uses, for naming missing tensors as the file would."""
    for name in tensors:
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix + "layers.") or name.startswith(prefix + "embed_tokens."):
                return prefix
    return "model."


# --- loading -----------------------------------------------------------------------------------


def _quantize_type(quantize: str | None) -> QType | None:
    if quantize is None:
        return None
    if str(quantize).lower() not in QUANTIZE_TYPES:
        raise ValueError(f"quantize={quantize!r} is not supported; supported: {', '.join(QUANTIZE_TYPES)}")
    return QType[str(quantize).upper()]


class _FileReader:
    """Row ranges of one safetensors file's tensors, through a memory map that is re-opened after
    every _REMAP_BYTES read: unmapping drops the file pages reading touched from this process's
    resident set, which would otherwise grow to the size of the file."""

    def __init__(self, file: Path):
        self.file, self.handle, self.read = file, None, 0

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self.handle is None or self.read >= _REMAP_BYTES:
            self.handle, self.read = _open(self.file), 0
        out = self.handle.get_slice(name)[start:stop]
        self.read += out.nbytes
        return out

    def close(self):
        self.handle = None


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buffer: jax.Array, rows: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer, rows, start, axis=0)


def _convert(host: np.ndarray, field: str, gemma: bool, qtype: QType | None, name: str):
    """Host rows of one tensor -> what the params hold (on host still): float32 norms (+1 for
    Gemma) and biases; matrices as stored, or quantized when their rows fit the type's blocks."""
    if field in _NORMS:
        w = host.astype(np.float32)
        return w + 1.0 if gemma else w  # Gemma's RMSNorm multiplies by (1 + w)
    if field in _BIASES:
        return host.astype(np.float32)
    if qtype is not None:
        from gguf_blocks.quantize import quantize

        for t in (qtype, _QUANTIZE_FALLBACK.get(qtype)):
            if t is not None and host.shape[-1] % GGML_QUANT_SIZES[t][0] == 0:
                return quantize(host, t, name)
    return host


def _load_tensor(reader: _FileReader, name: str, shape: tuple[int, ...], itemsize: int, convert):
    """One tensor onto the device, read _CHUNK_BYTES of rows at a time into a preallocated device
    buffer that each write donates, so the host holds one chunk at a time and the device never
    holds two copies of the tensor."""
    step = max(1, _CHUNK_BYTES // max(1, math.prod(shape[1:]) * itemsize))

    def rows(start, stop):
        host = reader.rows(name, start, stop)
        check_finite(reader.file, name, host)
        return host

    if step >= shape[0]:
        part = convert(rows(0, shape[0]))
        if isinstance(part, QTensor):
            return QTensor(jax.tree.map(jax.device_put, part.planes), part.qtype, part.shape)
        return jax.device_put(part)
    planes = qtype = None
    for start in range(0, shape[0], step):
        part = convert(rows(start, min(start + step, shape[0])))
        leaves = part.planes if isinstance(part, QTensor) else part
        if planes is None:
            qtype = part.qtype if isinstance(part, QTensor) else None
            planes = jax.tree.map(lambda a: jnp.zeros((shape[0], *a.shape[1:]), a.dtype), leaves)
        planes = jax.tree.map(lambda buf, a: _write_rows(buf, jax.device_put(a), start), planes, leaves)
        del part, leaves
    return planes if qtype is None else QTensor(planes, qtype, shape)


def load_hf_dir(path: str | os.PathLike, *, progress: bool = True, quantize: str | None = None
                ) -> tuple[ModelConfig, Params]:
    """A Hugging Face checkpoint directory -> (config, params on the default device).

    quantize: None keeps every weight in its file dtype; "q8_0", "q4_0", "q4_1", "q5_0", "q5_1" or
    "q4_k" quantizes the 2-D weights (embedding and head included) while loading. A weight whose
    row length is not a multiple of the type's block gets the fallback type (q4_k -> q5_0) or, if
    that does not fit either, stays dense.
    """
    path = Path(path)
    qtype = _quantize_type(quantize)
    model_type, cfg = _config(path)
    files = weight_files(path)
    tensors = _headers(files)
    plan = _plan(cfg, model_type, tensors, path)
    gemma = model_type == "gemma3_text"

    layers: list[dict] = [dict() for _ in range(cfg.n_layers)]
    top: dict = {}
    bar = tqdm(total=len(plan), desc="loading tensors", unit="tensor", disable=not progress, leave=False)
    for file in files:
        reader = _FileReader(file)
        for name, (f, dtype, shape) in tensors.items():  # in file order
            if f != file or name not in plan:
                continue
            layer, field = plan[name]
            convert = functools.partial(_convert, field=field, gemma=gemma, qtype=qtype, name=name)
            w = _load_tensor(reader, name, shape, _ITEMSIZE[dtype], convert)
            (top if layer is None else layers[layer])[field] = w
            bar.update()
        reader.close()
    bar.close()
    params = Params(embed=top["embed"], layers=tuple(LayerParams(**l) for l in layers),
                    final_norm=top["final_norm"], lm_head=None if cfg.tie_embeddings else top["lm_head"])
    return cfg, params


# --- info --------------------------------------------------------------------------------------


def describe_hf_dir(path: str | os.PathLike) -> dict:
    """What a checkpoint directory holds, from config.json and the safetensors headers (no weights
    are read): the same keys as `rjax.info.model_info` gives for a GGUF, plus `model_type`."""
    import collections
    import dataclasses

    path = Path(path)
    model_type, cfg = _config(path)
    files = weight_files(path)
    headers = _headers(files)
    _plan(cfg, model_type, headers, path)
    tensors = [dict(name=n, type=dtype, shape=list(shape), bytes=math.prod(shape) * _ITEMSIZE.get(dtype, 0))
               for n, (_, dtype, shape) in headers.items()]
    count, size = collections.Counter(), collections.Counter()
    for t in tensors:
        count[t["type"]] += 1
        size[t["type"]] += t["bytes"]
    config = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("layer_windows", "layer_rope_theta", "layer_rope_linear", "rope_freq_factors")}
    config["layer_windows"] = sorted({w for w in cfg.layer_windows if w}) or None
    return dict(path=str(path), file_bytes=sum(f.stat().st_size for f in files), architecture=cfg.arch,
                model_type=model_type, config=config,
                parameters=sum(math.prod(t["shape"]) for t in tensors),
                tensor_bytes=sum(t["bytes"] for t in tensors),
                tensor_types={k: dict(count=count[k], bytes=size[k]) for k in sorted(count)},
                tensors=tensors)

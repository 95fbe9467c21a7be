"""A Hugging Face checkpoint's config.json -> ModelConfig.

Every key is checked for type and range before a config is sized from it, with transformers'
defaults for the keys a config may leave out; errors are ModelFileErrors that name the file and
the key. Gemma 3's multimodal configs are read for their text model.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from rjax.loading.loaders.errors import MAX_CONTEXT, MAX_DIM, MAX_LAYERS, MAX_VOCAB, ModelFileError, read_json
from rjax.math.config import ModelConfig, RopeScaling, longrope_context

CONFIG_FILE = "config.json"

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma3_text",
                         "gemma3")
_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
         "qwen3_moe": "qwen3", "phi3": "phi3", "gemma3_text": "gemma3"}
# Mixture-of-experts model types -> the key that counts their experts by default
_EXPERT_COUNT = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts"}

# transformers' defaults for the keys a config.json may leave out, per model_type
_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu"),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=10000.0,
                    tie_word_embeddings=False, hidden_act="silu", sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu", sliding_window=4096,
                  use_sliding_window=False, max_window_layers=28),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu", sliding_window=4096,
                  use_sliding_window=False, max_window_layers=28),
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=1e6,
                    tie_word_embeddings=False, hidden_act="silu", sliding_window=None, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0,
                      tie_word_embeddings=False, hidden_act="silu", sliding_window=4096,
                      use_sliding_window=False, max_window_layers=28, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0,
                 tie_word_embeddings=False, hidden_act="silu", original_max_position_embeddings=4096),
    "gemma3_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, tie_word_embeddings=True,
                        hidden_activation="gelu_pytorch_tanh", head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=4096),
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# How configs count experts (Mixtral, Qwen-MoE, DeepSeek): a dense model_type that sets one is not dense
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


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
    hf = read_json(config_path)
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
    theta = _positive(keys, "rope_theta", params["rope_theta"] if params.get("rope_theta") is not None else theta_default)
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
        original = params.get("original_max_position_embeddings")
        original = context if original is None else original
        if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= MAX_CONTEXT:
            keys.fail(f"rope original_max_position_embeddings = {original!r:.80} is not an integer in "
                      f"[1, {MAX_CONTEXT:,}]")
        return theta, RopeScaling(number("factor"), number("low_freq_factor"), number("high_freq_factor"),
                                  original), 1.0
    return theta, None, 1.0


def _layer_types(keys: _Keys, n_layers: int, default: list[str]) -> list[str]:
    types = default if keys.hf.get("layer_types") is None else keys.hf["layer_types"]
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
    for key in _EXPERT_KEYS:
        if hf.get(key) and model_type not in _EXPERT_COUNT:
            keys.fail(f"{key} = {hf[key]!r:.80}: mixture-of-experts layers are not supported for "
                      f"model_type {model_type!r}")
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
    value = {} if keys.hf.get(key) is None else keys.hf[key]
    if not isinstance(value, dict):
        keys.fail(f"config key {key!r} = {value!r:.80} is not an object")
    return value


def _arch_config(keys: _Keys, model_type: str, hf: dict, common: dict, n_layers: int, d_model: int,
                 context: int) -> ModelConfig:
    if model_type == "gemma3_text":
        rp = _object(keys, "rope_parameters")
        if "full_attention" in rp or "sliding_attention" in rp:  # transformers 5: one dict per layer type
            global_rp, local_rp = rp.get("full_attention", {}), rp.get("sliding_attention", {})
        else:  # older configs: rope_theta + rope_scaling for global layers, rope_local_base_freq for local
            global_rp = {**_object(keys, "rope_scaling"), **rp}
            local_rp = {}
        g_theta, _, g_linear = _rope(keys, global_rp, keys.float("rope_theta"), context, ("default", "linear"))
        l_theta, _, l_linear = _rope(keys, local_rp, keys.float("rope_local_base_freq"), context, ("default", "linear"))
        # the pattern only matters without layer_types: every pattern-th layer is global
        pattern = keys.int("sliding_window_pattern", hf.get("_sliding_window_pattern", 6), maximum=MAX_LAYERS)
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
    extra = {}
    if model_type == "phi3" and rp.get("rope_type", rp.get("type")) in ("longrope", "su"):
        extra, rp = _longrope(keys, rp, head_dim=common["head_dim"], context=context), {
            k: v for k, v in rp.items() if k not in ("rope_type", "type")}
        common["context_length"] = extra.pop("context_length")
    theta, scaling, linear = _rope(keys, rp, keys.float("rope_theta"), context, ("default", "linear", "llama3"))
    if model_type in _EXPERT_COUNT:
        extra |= _experts(keys, model_type, n_layers)
    if model_type in ("mistral", "mixtral", "phi3"):  # one window for every layer, when the config sets one
        windows = (keys.window(),) * n_layers if "sliding_window" in hf or model_type == "mistral" else ()
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):  # windows only with use_sliding_window, on layers >= max_window_layers
        window = keys.window() if keys.get("use_sliding_window") else None
        first = keys.int("max_window_layers", minimum=0, maximum=MAX_LAYERS)
        types = _layer_types(keys, n_layers, ["sliding_attention" if window is not None and i >= first
                                              else "full_attention" for i in range(n_layers)])
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:  # llama has no sliding window
        windows = ()
    return ModelConfig(**common, rope_theta=theta, rope_scaling=scaling, layer_rope_linear=(linear,) * n_layers,
                       qkv_bias=model_type == "qwen2", qk_norm=model_type in ("qwen3", "qwen3_moe"), layer_windows=windows, **extra)


def _experts(keys: _Keys, model_type: str, n_layers: int) -> dict:
    """A mixture-of-experts config's expert fields -> ModelConfig fields; every layer must be one."""
    # transformers 5 saves either type's count as num_local_experts; Qwen's own configs say num_experts
    count_key = next((k for k in ("num_local_experts", "num_experts") if keys.hf.get(k) is not None),
                     _EXPERT_COUNT[model_type])
    n = keys.int(count_key, maximum=4096)
    used = keys.int("num_experts_per_tok", maximum=4096)
    if used > n:
        keys.fail(f"num_experts_per_tok = {used} is more than {count_key} = {n}")
    if model_type == "mixtral":  # Mixtral's experts are MLPs of intermediate_size; its top k always sum to 1
        return dict(n_experts=n, n_experts_used=used, expert_d_ff=keys.int("intermediate_size"), expert_norm=True)
    if keys.hf.get("mlp_only_layers") or keys.int("decoder_sparse_step") != 1:
        keys.fail(f"mlp_only_layers = {keys.hf.get('mlp_only_layers')!r:.80} / decoder_sparse_step = "
                  f"{keys.get('decoder_sparse_step')!r}: dense layers among the expert layers are not supported")
    return dict(n_experts=n, n_experts_used=used, expert_d_ff=keys.int("moe_intermediate_size"),
                expert_norm=keys.bool("norm_topk_prob"))


def _longrope(keys: _Keys, rp: dict, head_dim: int, context: int) -> dict:
    """Phi-3's LongRoPE ("longrope", or "su" as older configs call it) -> ModelConfig fields: the
    short factors as per-frequency divisors, the attention factor (which scales rope's cos and sin,
    so every q.k by its square) folded into the attention scale, the context they hold for."""
    original = rp.get("original_max_position_embeddings") or keys.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= MAX_CONTEXT:
        keys.fail(f"rope original_max_position_embeddings = {original!r:.80} is not an integer in [1, {MAX_CONTEXT:,}]")
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = rp.get(name)
        if (not isinstance(value, list) or len(value) != head_dim // 2
                or not all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                           for v in value)):
            keys.fail(f"longrope rope scaling needs {name!r}: {head_dim // 2} positive numbers (head_dim "
                      f"{head_dim} / 2), got {value!r:.80}")
        factors[name] = tuple(float(v) for v in value)
    factor = rp.get("factor") or context / original
    attention = rp.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    attention = _positive(keys, "rope attention_factor", attention)
    return dict(rope_freq_factors=factors["short_factor"], attn_scale=attention ** 2 / math.sqrt(head_dim),
                context_length=longrope_context(context, original, factors["short_factor"], factors["long_factor"]))


def checkpoint_config(path: Path) -> tuple[str, ModelConfig]:
    """(model_type, ModelConfig) of the checkpoint directory `path`."""
    model_type, hf = read_hf_config(path)
    return model_type, config_from_hf(model_type, hf, path / CONFIG_FILE)

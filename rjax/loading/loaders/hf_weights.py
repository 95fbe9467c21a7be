"""A Hugging Face checkpoint's weight files, read from their headers only: which files hold the
weights, what tensors they hold, and where each tensor goes in the params.

`tensor_plan` settles the whole checkpoint against the config before any weight is read: a
missing tensor, an unknown one, a shape that disagrees with config.json or an unsupported dtype
is a ModelFileError naming the file and the tensor.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16" dtype, which safe_open needs for BF16
from safetensors import SafetensorError, safe_open

from rjax.loading.loaders.errors import ModelFileError, listing, read_json
from rjax.loading.loaders.fields import expected_shape, missing_layer_fields
from rjax.math.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DENSE_DTYPES = ("BF16", "F16", "F32")  # what the forward pass holds or widens to float32 on load

# Layer tensor names (under `layers.N.`) -> LayerParams fields. Llama-style models have one norm
# before the MLP, which Hugging Face calls post_attention_layernorm; Gemma 3 has four norms.
_LAYER_COMMON = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    # Phi-3 stores q, k, v and gate, up stacked along the output rows, as the fused params hold them
    "self_attn.qkv_proj.weight": "wqkv", "mlp.gate_up_proj.weight": "w_gate_up",
}
_LAYER_LLAMA = {**_LAYER_COMMON, "post_attention_layernorm.weight": "ffn_norm"}
_LAYER_GEMMA = {**_LAYER_COMMON, "post_attention_layernorm.weight": "post_attn_norm",
                "pre_feedforward_layernorm.weight": "ffn_norm",
                "post_feedforward_layernorm.weight": "post_ffn_norm"}
# Mixture-of-experts layers (Qwen3-MoE's `mlp.`, Mixtral's `block_sparse_moe.`): the router, and each
# expert's MLP, stacked at load into one (n_experts, out, in) field per product.
_ROUTER = {"mlp.gate.weight": "router", "block_sparse_moe.gate.weight": "router"}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_FIELDS = {"gate_proj": "w_gate_exps", "w1": "w_gate_exps", "up_proj": "w_up_exps", "w3": "w_up_exps",
                  "down_proj": "w_down_exps", "w2": "w_down_exps"}
_TOP = {"embed_tokens.weight": "embed", "norm.weight": "final_norm", "lm_head.weight": "lm_head"}
# Where the text model's tensors live: plain causal LMs, and Gemma 3's multimodal checkpoints as
# transformers >= 4.52 saves them and as they were published before.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
# Tensors of a multimodal checkpoint that a text-only forward pass does not use.
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory: the shards its index names, or model.safetensors."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = read_json(index)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError) as e:
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


def open_safetensors(file: Path):
    """safe_open, with a header it cannot parse reported as a ModelFileError naming the file."""
    try:
        return safe_open(file, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(f"{file}: cannot read the safetensors header ({e})") from e


def read_headers(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every tensor of the files -> (file, dtype name, shape), read from the headers only
    (safetensors checks each header's offsets against its dtype, shape and the file's size)."""
    out = {}
    for file in files:
        with open_safetensors(file) as f:
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


def tensor_plan(cfg: ModelConfig, model_type: str, tensors: dict, where: Path
                ) -> dict[str, tuple[int | None, str]]:
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
            if cfg.n_experts and field is None:
                field = _ROUTER.get(parts[2])
                expert = _EXPERT.fullmatch(parts[2])
                if expert and int(expert[1]) < cfg.n_experts:
                    field = f"{_EXPERT_FIELDS[expert[2]]}.{int(expert[1])}"
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
                             f"{listing(unknown, 6)}")

    have = set(plan.values())
    inverse = {f: n for n, f in layer_map.items()}
    prefix = _prefix_of(tensors)
    inverse |= {"router": "mlp.gate.weight", **{f: f"mlp.experts.N.{n}.weight" for n, f in _EXPERT_FIELDS.items()}}
    missing = [f"{prefix}layers.{i}.{inverse[f]}" for i in range(cfg.n_layers)
               for f in missing_layer_fields(cfg, {f.split(".")[0] for j, f in have if j == i})]
    missing += [f"{prefix}layers.{i}: expert {e}'s {f}" for i in range(cfg.n_layers) for f in set(_EXPERT_FIELDS.values())
                for e in range(cfg.n_experts) if (i, f"{f}.0") in have and (i, f"{f}.{e}") not in have]
    missing = [f"{prefix}embed_tokens.weight"] * ((None, "embed") not in have) + missing
    missing += [f"{prefix}norm.weight"] * ((None, "final_norm") not in have)
    untied_head_missing = not cfg.tie_embeddings and (None, "lm_head") not in have
    missing += ["lm_head.weight (tie_word_embeddings is false)"] * untied_head_missing
    if missing:
        raise ModelFileError(f"{where}: missing tensors: {listing(missing, 6)}")
    for name, (_, field) in plan.items():
        file, dtype, shape = tensors[name]
        want = expected_shape(cfg, field.split(".")[0])[1:] if "." in field else expected_shape(cfg, field)
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


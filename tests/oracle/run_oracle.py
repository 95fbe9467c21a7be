"""The independent implementation rjax is checked against: transformers on CPU torch.

Run only by the oracle interpreter (`.oracle-venv/bin/python`, Python 3.11); the rjax env never
imports this file or torch. `tests/oracle/client.py` runs it in a subprocess and caches what it
writes. Every subcommand writes one output file or directory (`--out`):

  tokenize         ids (with and without special tokens), decode round trips, rendered chat template -> json
  logits           float32 logits for prompts given as token ids, then greedy decode with a KV cache -> npz
  save-pretrained  a GGUF's weights, tokenizer and generation config as a plain safetensors checkpoint -> dir
  save-tokenizer   only the tokenizer transformers builds from a model, as a Hugging Face directory -> dir
  random-qwen2     a small random-weight Qwen2 checkpoint with its own tiny byte-level tokenizer -> dir
  random-model     a small random-weight checkpoint of a dense or mixture-of-experts architecture -> dir
  to-gguf          a checkpoint directory converted by llama.cpp's own convert_hf_to_gguf.py (float32) -> .gguf

`serve` runs those subcommands one after another, read as JSON argument lists from stdin, each
answered by one JSON line on stdout: the client keeps one such process per test process, so torch
is imported and each model file is read and de-quantized once, not once per question.

A model is named by path: a `.gguf` file (loaded through transformers' GGUF support, which
de-quantizes to float32) or a Hugging Face checkpoint directory.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _location(model: str) -> tuple[str, dict]:
    """(directory, extra from_pretrained kwargs) for a `.gguf` file or a checkpoint directory."""
    path = Path(model).resolve()
    if path.is_dir():
        return str(path), {}
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    raise SystemExit(f"run_oracle: {model!r} is neither a .gguf file nor a checkpoint directory")


# Loads are kept for the next command of a `serve` process (the model files never change under a
# path: the client keys models by content, and cache entries are written once). Two models at most:
# the real ones take about 1 GB each in float32.
@functools.lru_cache(maxsize=2)
def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    directory, extra = _location(model)
    return AutoTokenizer.from_pretrained(directory, **extra)


@functools.lru_cache(maxsize=2)
def load_model(model: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    directory, extra = _location(model)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **extra)
    return loaded.eval()


def _read_gguf_once() -> None:
    """transformers parses a GGUF file's header anew for its config, its weights and its tokenizer
    (half a minute each for gemma3's 262,144-token vocabulary). The parsed reader only maps the
    file read-only, so one per file serves them all."""
    import gguf

    gguf.GGUFReader = functools.lru_cache(maxsize=2)(gguf.GGUFReader)


def _read_json(path: str):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _write_json(path: str, value) -> None:
    Path(path).write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")


# --- tokenize ---------------------------------------------------------------------------------


def cmd_tokenize(args) -> None:
    tok = load_tokenizer(args.model)
    texts = _read_json(args.texts)
    out: dict = {
        "tokenizer_class": type(tok).__name__,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "all_special_ids": sorted(tok.all_special_ids),
        "ids_with_special": [],
        "ids_without_special": [],
        # decode(encode(text, add_special_tokens=True)), keeping and skipping special tokens
        "decoded_with_special": [],
        "decoded_skip_special": [],
        "chat_template": tok.chat_template,
        "chat_rendered": None,
        "chat_ids": None,
    }
    for text in texts:
        with_special = tok(text, add_special_tokens=True)["input_ids"]
        without_special = tok(text, add_special_tokens=False)["input_ids"]
        out["ids_with_special"].append(list(with_special))
        out["ids_without_special"].append(list(without_special))
        out["decoded_with_special"].append(tok.decode(with_special, skip_special_tokens=False))
        out["decoded_skip_special"].append(tok.decode(with_special, skip_special_tokens=True))
    if args.messages:
        messages = _read_json(args.messages)
        if tok.chat_template is not None:
            rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # a BatchEncoding in transformers 5
                ids = ids["input_ids"]
            out["chat_rendered"] = rendered
            out["chat_ids"] = list(ids)
    _write_json(args.out, out)


# --- logits -----------------------------------------------------------------------------------


@torch.inference_mode()
def cmd_logits(args) -> None:
    """For each prompt: logits at the last prompt position (and optionally at every position);
    then greedy decoding one token at a time through the KV cache.

    Per prompt i the npz holds:
      last_logits_i  [V]     logits after the whole prompt
      step_tokens_i  [N]     the tokens fed during decoding: step_tokens[0] = argmax(last_logits),
                             step_tokens[k] = argmax(step_logits[k-1])
      step_logits_i  [N, V]  logits produced by feeding step_tokens[k]
      greedy_i       [G]     the greedy continuation (G = max(N, --greedy-tokens))
      all_logits_i   [T, V]  with --all-positions: logits at every prompt position
    """
    model = load_model(args.model)
    prompts = _read_json(args.prompts_ids)
    steps = args.decode_steps
    total = max(steps, args.greedy_tokens)
    arrays: dict[str, np.ndarray] = {}
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise SystemExit(f"run_oracle logits: prompt {i} is empty")
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model(input_ids=ids, use_cache=True)
        logits = out.logits[0].float()
        arrays[f"last_logits_{i}"] = logits[-1].numpy().copy()
        if args.all_positions:
            arrays[f"all_logits_{i}"] = logits.numpy().copy()
        past = out.past_key_values
        nxt = int(torch.argmax(logits[-1]))
        greedy, step_logits = [], []
        for k in range(total):
            greedy.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), past_key_values=past, use_cache=True)
            past = out.past_key_values
            row = out.logits[0, -1].float()
            if k < steps:
                step_logits.append(row.numpy().copy())
            nxt = int(torch.argmax(row))
        vocab = logits.shape[-1]
        arrays[f"step_tokens_{i}"] = np.asarray(greedy[:steps], dtype=np.int64)
        arrays[f"step_logits_{i}"] = np.stack(step_logits) if step_logits else np.zeros((0, vocab), np.float32)
        arrays[f"greedy_{i}"] = np.asarray(greedy, dtype=np.int64)
    arrays["num_prompts"] = np.asarray(len(prompts))
    with open(args.out, "wb") as f:
        np.savez(f, **arrays)


# --- save-pretrained --------------------------------------------------------------------------


def cmd_save_pretrained(args) -> None:
    """transformers will not save_pretrained a GGUF-loaded model, so its (de-quantized) weights
    are copied into a plain model built from the same config, which saves normally."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    gguf_model = load_model(args.model, dtype=torch.float32)
    config = copy.deepcopy(gguf_model.config)
    # The weights are saved de-quantized: the GGUF "quantization" must not follow them.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # A tied head appears as missing or unexpected depending on the model; anything else is a bug.
    stray = [k for k in list(missing) + list(unexpected) if not k.endswith("lm_head.weight")]
    if stray:
        raise SystemExit(f"run_oracle save-pretrained: state dict mismatch {stray[:10]}")
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    plain = plain.to(dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    load_tokenizer(args.model).save_pretrained(out)


def cmd_save_tokenizer(args) -> None:
    """Only the tokenizer transformers builds from a model, saved as a Hugging Face directory
    (tokenizer.json, tokenizer_config.json, chat_template.jinja when there is a template)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer(args.model).save_pretrained(out)


# --- random-qwen2 -----------------------------------------------------------------------------

# A few fixed merges so the tiny tokenizer is a real BPE (not only single bytes).
_TINY_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
    ("Ġ", "s"), ("r", "e"), ("a", "t"), ("Ġ", "c"), ("e", "n"), ("Ġ", "w"), ("o", "r"),
    ("Ġ", "i"), ("i", "s"), ("Ġ", "is"), ("Ġ", "f"), ("a", "n"), ("Ġ", "o"),
]
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tiny_byte_level_tokenizer():
    """A byte-level BPE tokenizer with the Qwen2 split rule, 256 byte tokens, a handful of merges
    and ChatML special tokens: saved offline, with no model file needed."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = []
    for left, right in _TINY_MERGES:
        if left + right in vocab or left not in vocab or right not in vocab:
            raise AssertionError(f"tiny tokenizer merge {left!r} {right!r} does not build on the vocabulary")
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
    )
    tok.chat_template = _CHATML_TEMPLATE
    return tok


@torch.no_grad()
def cmd_random_qwen2(args) -> None:
    """A small Qwen2 with random weights. Biases and norm weights are randomized too (transformers
    initializes them to 0 and 1), so a checker that ignores one of them fails."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(args.tokenizer) if args.tokenizer else tiny_byte_level_tokenizer()
    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=args.tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(args.seed + 1)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    eos = [i for i in (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
           if isinstance(i, int) and i != tok.unk_token_id]
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=eos or tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model = model.to(getattr(torch, args.dtype))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


# --- random-model -----------------------------------------------------------------------------

_RANDOM_MODEL_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


@torch.no_grad()
def cmd_random_model(args) -> None:
    """A small random-weight model of any supported architecture. `--config` (a JSON object) sets or
    overrides any config field, e.g. rope_parameters with llama3 scaling or a sliding_window. Biases
    and norm weights are randomized as in random-qwen2."""
    import transformers
    from transformers import GenerationConfig

    config_cls, model_cls = (getattr(transformers, n) for n in _RANDOM_MODEL_CLASSES[args.arch])
    tok = tiny_byte_level_tokenizer()
    fields = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=args.tie_word_embeddings,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    fields.update(json.loads(Path(args.config).read_text(encoding="utf-8")))
    torch.manual_seed(args.seed)
    model = model_cls(config_cls(**fields)).to(torch.float32)
    gen = torch.Generator().manual_seed(args.seed + 1)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        elif "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model = model.to(getattr(torch, args.dtype))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if args.arch == "phi3":  # llama.cpp's Phi-3 converter reads a byte-level BPE only when named GPT2Tokenizer
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["tokenizer_class"] = "GPT2Tokenizer"
        config_path.write_text(json.dumps(config), encoding="utf-8")


# --- to-gguf ----------------------------------------------------------------------------------

# The converter refuses a byte-level BPE whose pre-tokenizer it cannot recognize by the ids it gives
# for a probe text; the tiny tokenizer's ids are its own, so it is named for the split rule it uses.
_CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def cmd_to_gguf(args) -> None:
    """llama.cpp's convert_hf_to_gguf.py, with its own gguf-py, in a child process (the gguf package
    of this env must not be mixed with the converter's)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _CONVERT, args.converter, args.model, "--outtype", "f32",
                           "--outfile", args.out], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"run_oracle to-gguf: convert_hf_to_gguf.py failed ({proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")


# --- entry ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tokenize", help="ids, decode round trips and chat template rendering")
    t.add_argument("--model", required=True, help=".gguf file or checkpoint directory")
    t.add_argument("--texts", required=True, help="path of a JSON list of strings")
    t.add_argument("--messages", help="path of a JSON list of chat messages to render")
    t.add_argument("--out", required=True, help="output .json")
    t.set_defaults(run=cmd_tokenize)

    lg = sub.add_parser("logits", help="float32 logits and greedy decoding for prompts given as ids")
    lg.add_argument("--model", required=True)
    lg.add_argument("--prompts-ids", required=True, help="path of a JSON list of lists of token ids")
    lg.add_argument("--decode-steps", type=int, default=0)
    lg.add_argument("--greedy-tokens", type=int, default=0, help="length of the greedy continuation to record")
    lg.add_argument("--all-positions", action="store_true", help="also record logits at every prompt position")
    lg.add_argument("--out", required=True, help="output .npz")
    lg.set_defaults(run=cmd_logits)

    s = sub.add_parser("save-pretrained", help="a GGUF as a plain safetensors checkpoint directory")
    s.add_argument("--model", required=True)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--out", required=True, help="output directory")
    s.set_defaults(run=cmd_save_pretrained)

    st = sub.add_parser("save-tokenizer", help="only the tokenizer of a model, as a Hugging Face directory")
    st.add_argument("--model", required=True)
    st.add_argument("--out", required=True, help="output directory")
    st.set_defaults(run=cmd_save_tokenizer)

    r = sub.add_parser("random-qwen2", help="a small random-weight Qwen2 checkpoint directory")
    r.add_argument("--out", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--tokenizer", help=".gguf or directory whose tokenizer to use (default: a tiny byte-level one)")
    r.add_argument("--hidden", type=int, default=64)
    r.add_argument("--intermediate", type=int, default=128)
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--heads", type=int, default=4)
    r.add_argument("--kv-heads", type=int, default=2)
    r.add_argument("--max-positions", type=int, default=2048)
    r.add_argument("--rope-theta", type=float, default=10000.0)
    r.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.set_defaults(run=cmd_random_qwen2)

    m = sub.add_parser("random-model", help="a small random-weight checkpoint of a chosen architecture and config")
    m.add_argument("--arch", required=True, choices=sorted(_RANDOM_MODEL_CLASSES))
    m.add_argument("--config", required=True, help="path of a JSON object of config fields to set")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=True)
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.set_defaults(run=cmd_random_model)

    g = sub.add_parser("to-gguf", help="a checkpoint directory as llama.cpp's converter writes it (float32)")
    g.add_argument("--model", required=True, help="checkpoint directory")
    g.add_argument("--converter", required=True, help="llama.cpp's source directory (convert_hf_to_gguf.py, "
                   "conversion/, gguf-py/)")
    g.add_argument("--out", required=True, help="output .gguf")
    g.set_defaults(run=cmd_to_gguf)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    args.run(args)
    return 0


def serve() -> int:
    """Commands from stdin, one JSON argument list a line; after each, one JSON line on stdout:
    {"ok": true} or {"ok": false, "error": "..."}. Ends at the end of stdin."""
    # Replies go to the original stdout; whatever the libraries print goes to stderr.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _read_gguf_once()
    for line in sys.stdin:
        try:
            main(json.loads(line))
            reply = {"ok": True}
        except (Exception, SystemExit):  # argparse and the commands report errors as SystemExit
            reply = {"ok": False, "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["serve"] else main())

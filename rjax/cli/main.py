"""The `rjax` command: pull, info, generate, chat (and the subcommands other modules add)."""
from __future__ import annotations

import argparse
import json
import sys

from rjax.loading.catalog import add_model_argument


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="ngram|self:q4_0|MODEL",
                   help="speculative decoding (prints accepted/drafted counts): 'ngram' (prompt lookup), "
                        "'self:q4_0' or 'self:q8_0' (the model requantized drafts for itself), or a draft model "
                        "with the same tokenizer (catalog name, .gguf file, Hugging Face directory)")
    p.add_argument("--draft-tokens", type=_draft_tokens, default=None,
                   help="tokens drafted per verification, or 'auto' (chosen per dispatch by the acceptance rate); "
                        "default: for prompt lookup as many as the verification keeps on the decode attention "
                        "kernel (15, or 7 for wide query groups), for a draft model 4")
    p.add_argument("--kv-dtype", choices=("bf16", "int8", "fp8"), default="bf16",
                   help="KV cache: bf16 (unquantized, in the activation dtype: float32 on the CPU), int8 (one "
                        "scale per token and head) or fp8 (e4m3, one scale per head) (default bf16)")


def _add_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja2 chat template to use instead of the model file's (a base model has none: "
                        "without this its prompts are completed as raw text)")


def _draft_tokens(value: str):
    return value if value == "auto" else int(value)


def _sampling_kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)


def cmd_pull(a) -> int:
    from rjax.loading.catalog import DEFAULT_MODEL, list_models, pull

    if a.list:
        for m in list_models():
            print(f"{m.name:24} {m.size / 1e6:8.1f} MB  {'present' if m.present else 'not pulled'}  {m.path}")
        return 0
    print(pull(a.name or DEFAULT_MODEL))
    return 0


def cmd_list(a) -> int:
    from rjax.loading.catalog import local_models, rjax_home

    models = local_models()
    if a.json:
        print(json.dumps([dict(name=m.name, path=str(m.path), size=m.size, architecture=m.architecture,
                               quant=m.quant, error=m.error) for m in models], indent=2))
        return 0
    if not models:
        print(f"no models in {rjax_home() / 'models'}; `rjax pull NAME` fetches one", file=sys.stderr)
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'NAME':{width}}  {'SIZE':>10}  {'ARCH':8}  {'QUANT':8}  FILE")
    for m in models:
        print(f"{m.name:{width}}  {m.size / 1e6:7.1f} MB  {m.architecture or '?':8}  {m.quant or '?':8}  {m.path}"
              + (f"  ({m.error})" if m.error else ""))
    return 0


def cmd_info(a) -> int:
    from rjax.cli.info import format_info, model_info, model_plan

    if a.plan:
        gpu = None if a.backend is None else a.backend == "gpu"
        print(model_plan(a.model, rows=a.rows, tokens=a.tokens, gpu=gpu, paged=a.paged))
        return 0
    info = model_info(a.model, backend=a.backend)
    print(json.dumps(info, indent=2) if a.json else format_info(info, tensors=a.tensors))
    return 0


def _mesh(tp: int):
    """--tp N: a mesh over the first N devices (None for 1)."""
    if tp == 1:
        return None
    from rjax.math.tensor_parallel import make_tp

    return make_tp(tp).mesh


def _load_for_text(a, **kw):
    """The model for generate and chat: with --chat-template FILE as its template; a model file
    without one (a base model) is said so in one line, and its prompts are raw text."""
    import dataclasses
    from pathlib import Path

    import rjax
    from rjax.loading.tokenizer import compile_chat_template

    template = None
    if a.chat_template:
        try:
            template = Path(a.chat_template).read_text(encoding="utf-8")
            compile_chat_template(template)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {a.chat_template}: cannot read it ({e})") from None
        except Exception as e:  # jinja2's syntax errors
            raise ValueError(f"--chat-template {a.chat_template}: not a valid template ({e})") from None
    model = rjax.load(a.model, **kw)
    if template is not None:
        model = dataclasses.replace(model, tokenizer=dataclasses.replace(model.tokenizer, chat_template=template))
    elif model.tokenizer.chat_template is None and not getattr(a, "raw", False):
        print(f"rjax: {model.name} has no chat template (a base model): completing the raw text "
              f"(--chat-template FILE gives one)", file=sys.stderr)
    return model


def cmd_generate(a) -> int:
    import rjax

    model = _load_for_text(a, progress=not a.json, mesh=_mesh(a.tp))
    raw = a.raw or model.tokenizer.chat_template is None
    kw = _sampling_kwargs(a)
    if a.json or a.speculative:
        result = rjax.generate(model, a.prompt, raw=raw, speculative=a.speculative, draft_tokens=a.draft_tokens,
                               kv_dtype=a.kv_dtype, **kw)
        if a.json:
            print(json.dumps(result.to_json()))
            return 0
        print(result.text)
        s = result.speculative
        print(f"[speculative ({s['drafter']}): {s['accepted']} of {s['drafted']} drafted tokens accepted in "
              f"{s['steps']} steps; "
              f"decode {result.decode_tokens_per_s:.1f} tokens/s (compile {s['compile_s']:.1f} s left out), "
              f"finish: {result.finish_reason}]", file=sys.stderr)
        return 0
    stats: dict = {}
    chunks = rjax.stream(model, a.prompt, raw=raw, stats=stats, kv_dtype=a.kv_dtype, progress=True, **kw)
    try:
        for chunk in chunks:
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        chunks.close()  # waits for the device work under way: exiting while it runs aborts the process
        sys.stdout.write("\n")
        print("[interrupted]", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    if a.verbose:
        print(f"[compile {stats['compile_s']:.1f} s, ttft {stats['ttft_s']:.3f} s, "
              f"decode {stats['decode_tokens_per_s']:.1f} tokens/s, finish: {stats['finish_reasons'][0]}]", file=sys.stderr)
    return 0


def cmd_chat(a) -> int:
    from rjax.cli.chat_repl import run
    from rjax.loading.catalog import rjax_home
    from rjax.runtime.chat import ChatSession

    model = _load_for_text(a)
    session = ChatSession(model, system=a.system, kv_dtype=a.kv_dtype, speculative=a.speculative,
                          draft_tokens=a.draft_tokens, progress=True, **_sampling_kwargs(a))
    return run(session, history=rjax_home() / "chat_history")


def build_parser(extensions: bool = True) -> argparse.ArgumentParser:
    """The whole command; `extensions=False` leaves out the subcommands other modules add, whose
    modules import jax."""
    parser = argparse.ArgumentParser(prog="rjax", description="Functional LLM inference on JAX/XLA.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download a model into $RJAX_HOME: a catalog name, a GGUF of a Hugging Face "
                                    "repository, or a URL")
    p.add_argument("name", nargs="?", help="catalog name (default: the default model), org/repo:QUANT "
                                           "(e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M), org/repo/FILE.gguf, "
                                           "or https://.../FILE.gguf")
    p.add_argument("--list", action="store_true", help="list catalog models and whether they are present")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="the models that are local: name, size, architecture, quant, file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("info", help="a model's summary from its header: architecture, parameters, quant mix, "
                                    "context, chat template, memory plan")
    p.add_argument("model", help="catalog name, pulled name (org/repo:QUANT), .gguf file or Hugging Face directory")
    p.add_argument("--json", action="store_true", help="everything as one JSON object, the tensors included")
    p.add_argument("--tensors", action="store_true", help="list every tensor (name, type, shape) in natural order")
    p.add_argument("--plan", action="store_true",
                   help="print the fusion plan: which kernel takes each product, where norms and GLUs run")
    p.add_argument("--rows", type=int, default=1, help="with --plan: sequences in the step (default 1)")
    p.add_argument("--tokens", type=int, default=1, help="with --plan: tokens per sequence (default 1: decode)")
    p.add_argument("--backend", choices=("gpu", "cpu"), default=None,
                   help="the memory plan's and --plan's backend (default: the one present)")
    p.add_argument("--paged", action="store_true", help="with --plan: a paged cache, rows given (the serving engine)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="generate a reply (streams to stdout)")
    add_model_argument(p)
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    _add_template_arg(p)
    _add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens, text and timings")
    p.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr")
    _add_decoding_args(p)
    p.add_argument("--tp", type=int, default=1, help="split the model over this many GPUs (tensor parallel; default 1)")
    p.add_argument("prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="multi-turn conversation in the terminal (/help inside lists its commands)")
    add_model_argument(p)
    p.add_argument("--system", default=None, help="system prompt")
    _add_template_arg(p)
    _add_sampling_args(p)
    _add_decoding_args(p)
    p.set_defaults(func=cmd_chat)

    for register in _extensions() if extensions else ():
        register(sub)
    return parser


def _extensions():
    """Subcommands that live beside the modules they drive."""
    from rjax.cli import bench
    from rjax.loading import synth
    from rjax.runtime import scoring
    from rjax.server import cli as server_cli  # imports the server's packages only when `serve` runs

    return (bench.register_cli, synth.register_cli, scoring.register_cli, server_cli.register_cli)


def main(argv=None) -> int:
    from rjax.loading.catalog import CatalogError

    argv = sys.argv[1:] if argv is None else list(argv)
    # pull, list and info read files and compile nothing: they run without importing jax
    header_only = bool(argv) and argv[0] in ("pull", "list", "info") and "--plan" not in argv
    if not header_only and argv and not {"-h", "--help"} & set(argv):
        from rjax.loading.loaders import start_device

        start_device()  # beside the imports of the subcommands and the model's header
    args = build_parser(extensions=not header_only).parse_args(argv)
    if not header_only:
        from rjax.loading.xla_cache import use_default_compile_cache

        use_default_compile_cache()  # programs kept across runs, beside the models
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, CatalogError) as e:
        # Bad input (missing or damaged file, unknown model, prompt too long): one clear line.
        print(f"rjax: error: {e}", file=sys.stderr)
        return 2


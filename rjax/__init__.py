"""rjax: a functional LLM inference engine on JAX/XLA.

High level:  model = rjax.load("smollm2-135m-instruct"); rjax.generate(model, "Hello")
Functional:  rjax.init_cache, rjax.prefill, rjax.decode_step, rjax.decode_loop, rjax.greedy_decode_loop, rjax.sample
             are pure jitted functions of (static config, params pytree, cache pytree, inputs).
Scoring:     rjax.score, rjax.perplexity; rjax.token_logprobs is the jitted core.
Research:    rjax.forward (tokens or input embeddings -> logits, hidden states), differentiable;
             rjax.split_params / rjax.merge_params keep quantized weights out of jax.grad.
Serving:     rjax.ServingEngine (continuous batching over slots of a paged KV cache).
Errors:      rjax.ModelFileError (a damaged or unsupported model file), rjax.ContextLengthError
             (prompt plus new tokens beyond the context), rjax.InvalidTextError, rjax.NotDifferentiableError,
             rjax.ChatTemplateError (a chat template that does not compile, fails or runs past its limits).
Compiled programs are kept in $RJAX_HOME/xla-cache from rjax.load on; rjax.compile_cache(path or None) to change.
"""
import importlib
import importlib.util

# Names are imported on first use (PEP 562), so that `import rjax.loading.catalog`, `rjax info` and
# `rjax pull` do not start jax; `rjax.generate` and `from rjax import load` import what they name.
_EXPORTS = {
    "rjax.math.cache": ("KVCache", "init_cache"),
    "rjax.loading.catalog": ("DEFAULT_MODEL", "pull"),
    "rjax.math.config": ("ModelConfig",),
    "rjax.engine.steps": ("ContextLengthError", "decode_loop", "decode_step", "greedy_decode_loop", "pad_prompts",
                          "prefill", "prefill_and_sample", "prompt_bucket"),
    "rjax.runtime.generation": ("GenerationResult", "InvalidTextError", "generate", "stream"),
    "rjax.loading.loaders": ("Model", "load"),
    "rjax.loading.loaders.errors": ("ModelFileError",),
    "rjax.math.model": ("embed",),
    "rjax.math.params": ("Params",),
    "rjax.math.plan": ("Plan", "plan_for"),
    "rjax.math.research": ("ForwardResult", "NotDifferentiableError", "forward", "merge_params", "split_params"),
    "rjax.math.paged_cache": ("PagedKVCache", "init_paged_cache"),
    "rjax.math.sampling": ("SamplingParams", "sample"),
    "rjax.runtime.scoring": ("perplexity", "score", "token_logprobs"),
    "rjax.runtime.serving": ("ServingConfig", "ServingEngine"),
    "rjax.loading.xla_cache": ("compile_cache",),
    "rjax.loading.tokenizer": ("ChatTemplateError",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule: rjax.math.cache, rjax.math.tensor_parallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "ChatTemplateError", "ContextLengthError", "DEFAULT_MODEL", "ForwardResult", "GenerationResult", "InvalidTextError", "KVCache", "Model", "ModelConfig",
    "ModelFileError", "NotDifferentiableError", "PagedKVCache", "Params", "Plan",
    "SamplingParams", "ServingConfig", "ServingEngine",
    "compile_cache", "decode_loop", "decode_step", "embed", "forward", "generate", "greedy_decode_loop", "init_cache",
    "init_paged_cache", "load", "merge_params", "pad_prompts", "plan_for", "prefill",
    "perplexity", "prefill_and_sample", "prompt_bucket", "pull", "sample", "score", "split_params", "stream", "token_logprobs",
]

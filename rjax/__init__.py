"""rjax: a functional LLM inference engine on JAX/XLA.

High level:  model = rjax.load("smollm2-135m-instruct"); rjax.generate(model, "Hello")
Functional:  rjax.init_cache, rjax.prefill, rjax.decode_step, rjax.decode_loop, rjax.greedy_decode_loop, rjax.sample
             are pure jitted functions of (static config, params pytree, cache pytree, inputs).
Scoring:     rjax.score, rjax.perplexity; rjax.token_logprobs is the jitted core.
Serving:     rjax.ServingEngine (continuous batching over slots of a paged KV cache).
Errors:      rjax.ModelFileError (a damaged or unsupported model file), rjax.ContextLengthError
             (prompt plus new tokens beyond the context), rjax.InvalidTextError.
"""
from rjax.cache import KVCache, init_cache
from rjax.catalog import DEFAULT_MODEL, pull
from rjax.config import ModelConfig
from rjax.engine import (ContextLengthError, decode_loop, decode_step, greedy_decode_loop, pad_prompts, prefill,
                         prefill_and_sample, prompt_bucket)
from rjax.generation import GenerationResult, InvalidTextError, generate, stream
from rjax.loaders import Model, load
from rjax.loaders.errors import ModelFileError
from rjax.model import Params, forward
from rjax.plan import Plan, plan_for
from rjax.paged_cache import PagedKVCache, init_paged_cache
from rjax.sampling import SamplingParams, sample
from rjax.scoring import perplexity, score, token_logprobs
from rjax.serving import ServingConfig, ServingEngine

__all__ = [
    "ContextLengthError", "DEFAULT_MODEL", "GenerationResult", "InvalidTextError", "KVCache", "Model", "ModelConfig",
    "ModelFileError", "PagedKVCache", "Params", "Plan",
    "SamplingParams", "ServingConfig", "ServingEngine",
    "decode_loop", "decode_step", "forward", "generate", "greedy_decode_loop", "init_cache", "init_paged_cache", "load", "pad_prompts", "plan_for",
    "prefill",
    "perplexity", "prefill_and_sample", "prompt_bucket", "pull", "sample", "score", "stream", "token_logprobs",
]

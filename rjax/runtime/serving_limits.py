"""What a `ServingEngine` holds: its limits (`ServingConfig`, or `fit_config` for the device's
free memory). What it accepts of a request is `rjax.runtime.request`'s to check.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine.memory import QUANTIZED_KV, plan_memory
from rjax.engine.steps import PROMPT_BUCKETS
from rjax.math.config import ModelConfig
from rjax.runtime.request import is_int


# What the serving engine can draft with: prompt lookup, or a draft model (given to the
# ServingEngine beside the target: arrays have no place in this static config).
SPECULATIVE = (None, "ngram", "model")
MAX_DRAFT_TOKENS = 16  # drafts per verification, here and in rjax.generate


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    n_slots: int = 32
    max_len: int = 2048                 # positions per sequence (prompt + generated)
    page_size: int | None = 16          # None: a contiguous cache [L, n_slots, Hkv, max_len, D]
    n_pages: int | None = None          # page pool size; None: every slot can reach max_len
    steps_per_dispatch: int = 8
    # Prompt counts a prefill call is padded to (one compiled program each); the last is the most
    # prompts packed into one call.
    prefill_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    # Padded tokens per prefill call: prompts are packed up to this, and a longer prompt is
    # prefilled in chunks (`chunk_tokens`), one per step, between the running slots' decode
    # dispatches, so that it neither needs a program of its length nor stalls the others.
    max_prefill_tokens: int = 4096
    max_stop_ids: int = 8               # stop ids per request
    # The KV cache: a float dtype name ("float32", "bfloat16"; "bf16" is taken for "bfloat16"),
    # which is also the dtype the engine computes in, or "int8" / "fp8" (rjax.math.cache.KV_DTYPES),
    # quantized when written, the engine computing in `activation_dtype` (None: bfloat16 on a
    # GPU, float32 elsewhere).
    kv_dtype: str = "float32"
    activation_dtype: str | None = None
    # Full pages of earlier sequences are kept and shared by later prompts that start with the
    # same tokens (paged caches only; see rjax.runtime.pages).
    prefix_cache: bool = True
    # Speculative decoding: "ngram" drafts `draft_tokens` tokens per slot and round by prompt
    # lookup, "model" with a draft model (ServingEngine's `draft`), every slot's drafts verified
    # in one forward pass (rjax.engine.speculative.speculative_dispatch, `steps_per_dispatch` rounds per
    # dispatch); None decodes one token per step.
    speculative: str | None = None
    draft_tokens: int = 4

    def __post_init__(self):
        if self.kv_dtype == "bf16":
            object.__setattr__(self, "kv_dtype", "bfloat16")
        if self.kv_dtype not in QUANTIZED_KV and not _is_float(self.kv_dtype):
            raise ValueError(f"ServingConfig.kv_dtype must be a float dtype name, 'bf16', 'int8' or 'fp8', "
                             f"got {self.kv_dtype!r}")
        if self.activation_dtype is not None and not _is_float(self.activation_dtype):
            raise ValueError(f"ServingConfig.activation_dtype must be a float dtype name, got {self.activation_dtype!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"ServingConfig.speculative must be one of {SPECULATIVE}, got {self.speculative!r}")
        if not is_int(self.draft_tokens) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"ServingConfig.draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {self.draft_tokens!r}")
        for name in ("n_slots", "max_len", "steps_per_dispatch", "max_prefill_tokens", "max_stop_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServingConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens < PROMPT_BUCKETS[0]:
            raise ValueError(f"ServingConfig.max_prefill_tokens must be at least the smallest prompt bucket "
                             f"{PROMPT_BUCKETS[0]}, got {self.max_prefill_tokens}")
        if not self.prefill_buckets or list(self.prefill_buckets) != sorted(set(self.prefill_buckets)) \
                or self.prefill_buckets[0] < 1:
            raise ValueError(f"ServingConfig.prefill_buckets must be increasing counts >= 1, got {self.prefill_buckets}")
        if self.page_size is not None:
            if self.page_size < 1 or self.page_size & (self.page_size - 1):
                raise ValueError(f"ServingConfig.page_size must be a power of two, got {self.page_size}")
            if self.max_len % self.page_size:
                raise ValueError(f"ServingConfig.max_len {self.max_len} is not a multiple of page_size {self.page_size}")
            if self.n_pages is not None and self.n_pages < self.max_pages:
                raise ValueError(f"ServingConfig.n_pages {self.n_pages} cannot hold one sequence of max_len "
                                 f"{self.max_len} ({self.max_pages} pages of {self.page_size})")
        elif self.n_pages is not None:
            raise ValueError("ServingConfig.n_pages needs a page_size")

    @property
    def chunk_tokens(self) -> int:
        """The most prompt tokens of one sequence a prefill call takes: the longest prompt
        bucket within `max_prefill_tokens`."""
        return max(b for b in PROMPT_BUCKETS if b <= self.max_prefill_tokens)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Running-slot counts a paged decode dispatch is padded to (one program each): a decode
        step costs the bucket's batch, not n_slots. Powers of 4 below n_slots, then n_slots."""
        if not self.paged:
            return (self.n_slots,)
        return tuple(4 ** i for i in range(8) if 4 ** i < self.n_slots) + (self.n_slots,)

    def decode_bucket(self, n_running: int) -> int:
        return next(b for b in self.decode_buckets if b >= n_running)

    @property
    def dtype(self):
        """The dtype the engine computes in (and, unless quantized, stores K/V in)."""
        if self.kv_dtype not in QUANTIZED_KV:
            return jnp.dtype(self.kv_dtype)
        if self.activation_dtype is not None:
            return jnp.dtype(self.activation_dtype)
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)

    @property
    def cache_kv_dtype(self) -> str:
        """`kv_dtype` as rjax.math.cache.init_cache takes it ("bf16": unquantized, in `dtype`)."""
        return self.kv_dtype if self.kv_dtype in QUANTIZED_KV else "bf16"

    @property
    def max_prefill_prompts(self) -> int:
        return self.prefill_buckets[-1]

    def prefill_bucket(self, n_prompts: int) -> int:
        return next(b for b in self.prefill_buckets if b >= n_prompts)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def max_pages(self) -> int:
        return self.max_len // self.page_size

    @property
    def pool_pages(self) -> int:
        return self.n_slots * self.max_pages if self.n_pages is None else self.n_pages


def _is_float(name) -> bool:
    try:
        d = jnp.dtype(name)
    except TypeError:
        return False
    return jnp.issubdtype(d, jnp.floating) and d.itemsize >= 2  # fp8 is a KV format, not a compute dtype


def fit_config(cfg: ModelConfig, *, max_len: int, page_size: int | None = 16, n_slots: int | None = None,
               tokens_per_slot: int | None = None, params_bytes: int = 0, reserve_bytes: int | None = None,
               available: int | None = None, budget_bytes: int | None = None, tp: int = 1,
               draft_cfg: ModelConfig | None = None, **settings) -> ServingConfig:
    """A ServingConfig whose slots (unless given) and pages are what the device's free memory
    holds (see `rjax.engine.memory.plan_memory`; draft_cfg: a draft model's cache beside the target's);
    raises MemoryFitError when not even one sequence fits."""
    base = ServingConfig(n_slots=n_slots or 1, max_len=max_len, page_size=page_size, **settings)
    plan = plan_memory(cfg, max_len=max_len, page_size=page_size, n_slots=n_slots, tokens_per_slot=tokens_per_slot,
                       prefill_tokens=base.max_prefill_tokens, prefill_prompts=base.max_prefill_prompts,
                       dtype=base.kv_dtype, params_bytes=params_bytes, reserve_bytes=reserve_bytes,
                       available=available, budget_bytes=budget_bytes, tp=tp, draft_cfg=draft_cfg)
    return dataclasses.replace(base, n_slots=plan.n_slots, n_pages=plan.n_pages)

"""How many KV-cache pages and slots fit in the device's memory, decided before anything is allocated.

Free memory comes from the device's `memory_stats()` on GPUs (the limit less what is in use, and
less the allocator pool's free bytes beyond its largest free block), and on
backends without statistics (the CPU) a configured budget, else the host's available physical
memory. From it come, in this order: the params (when they are not resident yet), a reserve, the
workspace of the largest dispatch (an estimate, see `workspace_bytes`), and what is left holds
KV-cache pages. A configuration that does not fit is refused with `MemoryFitError`, naming the
bytes needed and the bytes available, instead of an out-of-memory error on the first request.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from rjax.math.config import ModelConfig

MiB = 1 << 20
DEFAULT_MAX_SLOTS = 256


class MemoryFitError(ValueError):
    pass


def available_bytes(device=None, budget_bytes: int | None = None) -> tuple[int, str]:
    """(free bytes, where the number comes from) for `device` (default: the first device).
    `budget_bytes` is used where the device keeps no memory statistics."""
    if device is None:
        import jax  # here, not above: `rjax info` plans for the CPU without starting jax

        device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        limit, in_use = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
        if "pool_bytes" in stats and "largest_free_block_bytes" in stats:
            # The allocator's pool keeps what it once held (a load's temporaries) in pieces; the
            # cache's large arrays fit only into its largest free piece or into memory beyond the
            # pool. Counting every free byte of the pool let the H100 plan llama-8b caches whose
            # last layer's array (1 GiB) then found no room.
            pooled = int(stats["pool_bytes"])
            return min(limit - in_use, limit - pooled + int(stats["largest_free_block_bytes"])), \
                f"{device} memory_stats"
        return limit - in_use, f"{device} memory_stats"
    if budget_bytes is not None:
        return int(budget_bytes), f"the configured budget for {device}"
    return host_available_bytes(), f"available host memory for {device}"


def host_available_bytes() -> int:
    # MemAvailable counts reclaimable page cache too; free pages alone would understate it.
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tree_bytes(tree) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


QUANTIZED_KV = ("int8", "fp8")


def kv_bytes_per_position(cfg: ModelConfig, dtype) -> int:
    """K and V bytes of one position of one sequence, over all layers. dtype: a float dtype (an
    unquantized cache), or "int8" (a byte per value plus a float32 scale per token and head) or
    "fp8" (a byte per value; its per-head scales are a constant few bytes)."""
    per_head = {"int8": cfg.head_dim + 4, "fp8": cfg.head_dim}.get(_kv_name(dtype))
    if per_head is None:
        per_head = cfg.head_dim * _itemsize(dtype)
    return 2 * cfg.n_layers * cfg.n_kv_heads * per_head


def _kv_name(dtype):
    return dtype if isinstance(dtype, str) and dtype in QUANTIZED_KV else None


def _itemsize(dtype) -> int:
    if isinstance(dtype, str) and dtype == "bf16":
        return 2
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return np.dtype(dtype).itemsize
    import jax.numpy as jnp

    return np.dtype(jnp.dtype(dtype)).itemsize


def _float_item(dtype) -> int:
    """Bytes per value of the float K/V attention reads on the CPU: a quantized cache is
    dequantized to float32 there."""
    return 4 if _kv_name(dtype) else _itemsize(dtype)


def workspace_bytes(cfg: ModelConfig, *, n_slots: int, max_len: int, prefill_tokens: int, prefill_prompts: int,
                    dtype, backend: str | None = None) -> int:
    """An estimate of the temporary memory of the largest dispatch (decode of every slot, or one
    prefill call), beyond the params and the cache: per-layer activations (float32 upper bound),
    logits plus the copies sampling makes, and where attention runs as the pure-JAX
    reference (not on GPUs) the gathered cache and score matrices, plus a dequantized weight."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    item = _float_item(dtype)
    ffn = max(cfg.d_ff, cfg.n_experts_used * cfg.expert_d_ff)  # a mixture computes each token's k experts
    per_token = 4 * (4 * cfg.d_model + 3 * ffn + 2 * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
    logits = 6 * 4 * cfg.vocab_size
    decode = n_slots * (per_token + logits)
    prefill = prefill_tokens * per_token + prefill_prompts * logits
    if cfg.n_experts:  # the experts a step dequantizes at once (float32 bound), in the form plan.experts_form
        expert = 4 * 3 * cfg.expert_d_ff * cfg.d_model  # picks: each row's k gathered, or 8 tiles' at a time
        pairs = n_slots * cfg.n_experts_used
        decode += (pairs if pairs < cfg.n_experts else 8) * expert
        prefill += 8 * expert
    if backend != "gpu":
        gathered = 2 * cfg.n_kv_heads * max_len * cfg.head_dim * item
        decode += n_slots * (gathered + 2 * 4 * cfg.n_heads * max_len)
        prefill += prefill_prompts * gathered + 2 * 4 * prefill_tokens * cfg.n_heads * max_len
        dequant = 2 * 4 * max(cfg.vocab_size, cfg.d_ff) * cfg.d_model
        decode, prefill = decode + dequant, prefill + dequant
    return int(max(decode, prefill))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    n_slots: int
    n_pages: int | None       # None: contiguous cache
    page_size: int | None
    max_len: int
    kv_bytes: int
    workspace_bytes: int
    params_bytes: int
    reserve_bytes: int
    available_bytes: int
    source: str

    @property
    def needed_bytes(self) -> int:
        return self.kv_bytes + self.workspace_bytes + self.params_bytes + self.reserve_bytes


def needed_tp(split: int, fixed: int, avail: int, tp: int = 1, most: int = 64) -> int | None:
    """The fewest devices (a power of two above tp) on which one device's share of `split`
    bytes (each of tp devices' share now: params and KV cache) fits beside `fixed` bytes every
    device needs whole (workspace, reserve); None if not even `most` do."""
    n = tp * 2
    while n <= most:
        if split * tp / n + fixed <= avail:
            return n
        n *= 2
    return None


def _refuse(what: str, kv: int, ws: int, params: int, reserve: int, avail: int, source: str, tp: int = 1):
    need = kv + ws + params + reserve
    more = needed_tp(kv + params, ws + reserve, avail, tp)
    split = f" (per device, over tp={tp} devices)" if tp > 1 else ""
    hint = f"; split over {more} devices (--tp {more}) to fit" if more else ""
    raise MemoryFitError(
        f"{what} does not fit{split}: it needs {need:,} bytes (KV cache {kv:,} + workspace {ws:,} + params "
        f"{params:,} + reserve {reserve:,}); {source} has {avail:,} bytes available{hint}")


def plan_memory(cfg: ModelConfig, *, max_len: int, page_size: int | None = 16, n_slots: int | None = None,
                n_pages: int | None = None, tokens_per_slot: int | None = None, max_slots: int = DEFAULT_MAX_SLOTS,
                prefill_tokens: int = 4096, prefill_prompts: int = 16, dtype=np.float32, params_bytes: int = 0,
                reserve_bytes: int | None = None, available: int | None = None, budget_bytes: int | None = None,
                device=None, tp: int = 1, draft_cfg: ModelConfig | None = None,
                backend: str | None = None) -> MemoryPlan:
    """The slots and pages that fit, or MemoryFitError.

    dtype: the KV dtype, a float dtype or "int8" / "fp8" (`kv_bytes_per_position`).
    max_len: positions per sequence. page_size None: a contiguous cache (every slot holds
    max_len positions). n_slots / n_pages: given, they are checked; None, the largest that fit
    are chosen (slots up to `max_slots`; with pages, enough slots that each can hold
    `tokens_per_slot` positions, default max_len). params_bytes: params not yet on the device
    (0 when they are: the free memory already excludes them). reserve_bytes: kept free (default
    the larger of 256 MiB and 5% of the free memory). available: free bytes, else measured on
    `device` (`budget_bytes` where the device has no statistics). tp: the model is split over tp
    devices (rjax.math.tensor_parallel; cfg is the split config): every number is one device's, the
    cache and params_bytes (the whole model's) divided by tp; a refusal says how many devices
    would fit. draft_cfg: a speculative draft model's KV cache beside the target's, of the same
    slots, pages and dtype (counted in the KV cache; its workspace is the target's, reused).
    backend: "gpu" or "cpu", the workspace estimate's (default jax's default backend).
    """
    if available is None:
        available, source = available_bytes(device, budget_bytes)
    else:
        source = "the given budget"
    reserve = max(256 * MiB, available // 20) if reserve_bytes is None else int(reserve_bytes)
    per_pos = kv_bytes_per_position(cfg, dtype) + (kv_bytes_per_position(draft_cfg, dtype) if draft_cfg else 0)
    per_pos //= tp
    params_bytes = -(-params_bytes // tp)

    def ws(n):
        return workspace_bytes(cfg, n_slots=n, max_len=max_len, prefill_tokens=prefill_tokens,
                               prefill_prompts=min(prefill_prompts, n), dtype=dtype, backend=backend)

    fixed = params_bytes + reserve

    def plan(n, pages, kv):
        return MemoryPlan(n, pages, page_size, max_len, kv, ws(n), params_bytes, reserve, available, source)

    if page_size is None:
        def fits(n):
            return n * max_len * per_pos + ws(n) + fixed <= available

        if n_slots is None:
            n_slots = max((n for n in range(1, max_slots + 1) if fits(n)), default=0)
            if not n_slots:
                _refuse(f"one slot of {max_len} positions", max_len * per_pos, ws(1), params_bytes, reserve,
                        available, source, tp)
        elif not fits(n_slots):
            _refuse(f"a contiguous KV cache of {n_slots} slots x {max_len} positions", n_slots * max_len * per_pos,
                    ws(n_slots), params_bytes, reserve, available, source, tp)
        return plan(n_slots, None, n_slots * max_len * per_pos)

    page_bytes = per_pos * page_size
    max_pages = -(-max_len // page_size)
    slot_pages = -(-(tokens_per_slot or max_len) // page_size)

    def pages_that_fit(n):
        return max(0, (available - fixed - ws(n)) // page_bytes)

    if n_slots is None:
        n_slots = max((n for n in range(1, max_slots + 1) if n * slot_pages <= pages_that_fit(n)), default=0)
        if not n_slots:
            _refuse(f"one slot of {tokens_per_slot or max_len} positions in pages of {page_size}",
                    slot_pages * page_bytes, ws(1), params_bytes, reserve, available, source, tp)
    if n_pages is None:
        # More pages than every slot at full length can use would be wasted.
        n_pages = min(pages_that_fit(n_slots), n_slots * max_pages)
        if n_pages < max_pages:
            _refuse(f"{n_slots} slots with one sequence of {max_len} positions in pages of {page_size}",
                    max_pages * page_bytes, ws(n_slots), params_bytes, reserve, available, source, tp)
    elif n_pages > pages_that_fit(n_slots):
        _refuse(f"a paged KV cache of {n_pages} pages x {page_size} positions for {n_slots} slots",
                n_pages * page_bytes, ws(n_slots), params_bytes, reserve, available, source, tp)
    return plan(n_slots, int(n_pages), int(n_pages) * page_bytes)

"""Decode GEMV / skinny GEMM (M = 1..64): each weight byte is read from HBM once per call and
dequantized on chip, by one of three kernels:

- int8_gemv.py: int8-quantized activations and dp4a integer dot products, for half-precision
  activations, the types and row counts where it measured faster (`uses_int8`);
- wgmma_skinny.py: Q4_K, Q8_0, Q6_K, Q4_0, Q4_1 and Q5_0 against bf16 activations on Hopper's
  wgmma (Mosaic GPU), the weight dequantized straight into the MMA's register operand
  (`uses_wgmma`);
- kernel.py: the float kernel with one M tile (CUDA-core FMAs or tensor-core MMAs), for
  everything else, and for float32 activations, where it is exact.

Which kernel takes a product is decided by `decode_path` from the product's shape, type and
dtype and a `Tuning`: the row and size thresholds measured on the H100 (docs/kernels.md has
the numbers). `Tuning()` holds the measured defaults; a benchmark or test that wants another
choice passes its own, nothing here is mutated. Small N gets split along K (partial sums
added by the consumer) so that every SM has weight to stream.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import GatedX
from pallas_kernels.quant_matmul import int8_formats
from pallas_kernels.quant_matmul import int8_gemv as int8
from pallas_kernels.quant_matmul import wgmma_skinny as wgmma
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.tiles import supports_bf16x2
from pallas_kernels.rms_norm.pending import NormedRows, PendingNorm
from gguf_blocks.qtensor import QTensor

MAX_M = 64
# Float kernel, tensor-core path (H100): 64-row tiles, 256 K values per step, 4 warps and
# 320..528 programs (2.4..4 per SM) were fastest; larger tiles or 8 warps lost.
BLOCK_N = 64
VALUES_PER_STEP = 256
PROGRAMS = 320
PROGRAMS_BY_TYPE = {QType.Q4_K: 528}
# At M = 1 the CUDA-core path with small 8..16-row tiles beat the tensor-core path for these
# types, and lost for Q4_K (docs/kernels.md, "The float kernel").
FMA_AT_M1 = {
    QType.Q8_0: dict(block_n=16, programs=264),
    QType.Q6_K: dict(block_n=16, programs=264),
    QType.Q4_0: dict(block_n=8, programs=264),
    QType.Q4_1: dict(block_n=8, programs=264),
    QType.Q5_0: dict(block_n=16, programs=264),
}
# The int8 kernel's tiles: block_n, values per step, warps, prefetch (best at the 8B shapes).
INT8_TILES = {
    QType.Q8_0: (8, 512, 4, True),
    QType.Q4_K: (8, 1024, 4, True),    # for Q4_KChunks (with packed scales prefetch was slower)
    QType.Q4_1: (32, 256, 4, False),
    # Q4_0 reads words (`reads_words`); these tiles beat (32, 256, 4, False) on bytes.
    QType.Q4_0: (16, 1024, 4, True),
    # LM heads, scales as words; other tiles and byte scales lost (docs/kernels.md, "The int8 GEMV").
    QType.Q6_K: (32, 512, 4, True),
}
INT8_PROGRAMS = 264
# The bf16x2 tiles of the float kernel: 64 rows, one super-block per step, about 448
# programs, 4 warps, 2 stages.
BF16X2_TILES = dict(block_n=64, values_per_step=256, programs=448, num_warps=4, num_stages=2)


def _per_type(**kw) -> tuple:
    return tuple(sorted(((QType[k], v) for k, v in kw.items()), key=lambda kv: kv[0]))


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Which decode kernel takes which product, and which producer/consumer fusions run: the
    thresholds measured on the H100 (docs/kernels.md). Frozen and hashable, so a plan built
    from it can be a static argument. Per-type fields are ((QType, value), ...) pairs; `get`
    reads them."""

    # int8 GEMV: up to this many rows per type (beyond, the MMA kernels win), from this many
    # weight values (Q4_1/Q4_0 small weights stay on the float kernel; Q6_K only LM heads).
    int8_max_m: tuple = _per_type(Q8_0=4, Q4_K=4, Q4_1=4, Q4_0=4, Q6_K=1)
    int8_min_values: tuple = _per_type(Q4_K=0, Q8_0=0, Q4_1=2**24, Q4_0=2**24, Q6_K=2**27)
    # Beyond int8.ROUNDS_IN_KERNEL_MAX_M rows x is rounded in a pass of its own first: only
    # for weights this large (Q8_0 at batch 8 lost otherwise).
    int8_min_values_rounded_first: int = 2**24
    # From this many weight values the producer of x (the norm or GLU kernel before the
    # product) rounds it to int8 instead of every program of the product: Q4_K at every size
    # (in-kernel rounding costs it most at the 8B shapes), Q8_0 from 2**25.
    int8_producer_min_values: tuple = _per_type(Q4_K=0, Q8_0=2**25, Q4_1=2**25, Q4_0=2**25)
    # Down products of up to this many rows on the float kernel's CUDA-core tiles take the
    # GLU's [gate | up] and apply it as they load x (30 kernels fewer in a smollm2 step).
    gated_x_max_m: int = 1
    # Products on the int8 GEMV of up to this many rows whose output goes through the residual
    # add and an RMS norm into other int8 products do that add and norm in their own kernel
    # (it gains at batch 1 and loses at batch 4, where the last program merges four rows).
    add_norm_max_m: int = 1
    # Products of up to this many rows on the float kernel's CUDA-core tiles take the residual
    # add + RMS norm before them pending (a norm kernel fewer).
    pending_norm_max_m: int = 1
    # Programs whose rows exceed this many tiles take more weight rows (each loads x's whole row).
    pending_norm_max_tiles: int = 640
    # Products of up to this many rows on the float kernel's tensor-core tiles whose output goes
    # through the residual add and an RMS norm into other such products do that add and norm
    # in their own kernel (a speculative verification's positions: two norm kernels fewer per layer).
    rows_add_norm_max_m: int = 16
    # The float kernel's tensor-core tiles dequantize Q4_K/Q4_0/Q4_1 with bf16x2 PTX for up to
    # this many rows, where they beat the float32 path. 0 turns it off.
    bf16x2_max_m: int = MAX_M
    # The wgmma kernel: up to this many rows, from the per-type fewest rows and weight sizes
    # (x's permutation into its K order costs small Q4_K/Q4_0/Q4_1 products what it gains).
    wgmma_max_m: int = MAX_M
    wgmma_min_m: tuple = _per_type(Q4_K=2, Q8_0=2, Q6_K=1, Q4_0=2, Q4_1=2, Q5_0=1)
    wgmma_min_values: tuple = _per_type(Q4_K=2**24, Q8_0=0, Q6_K=0, Q4_0=2**24, Q4_1=2**24, Q5_0=0)
    # Weights held as int32 words on the GPU from this many values (their int8 GEMV and wgmma
    # kernels read words faster; Q8_0 only where the wgmma kernel takes its batched products).
    words_min_values: tuple = _per_type(Q4_K=0, Q6_K=2**27, Q8_0=0, Q4_0=2**24)
    # One-token decode steps of up to this many sequences run rotation, K/V append and
    # attention as one kernel (decode_rope_attention): one launch fewer per layer.
    fused_rope_max_rows: int = 256
    # That kernel hands its output to an int8 output product rounded to int8, so that the
    # product does not round it per program.
    quantized_attention_out: bool = True

    @staticmethod
    def get(pairs: tuple, qtype: QType, default=None):
        for t, v in pairs:
            if t == qtype:
                return v
        return default

    def replace(self, **changes) -> "Tuning":
        """A copy with some fields changed; per-type fields may be given as {QType: value}
        (merged into the defaults)."""
        out = {}
        for name, value in changes.items():
            if isinstance(value, dict):
                merged = dict(getattr(self, name))
                merged.update(value)
                value = tuple(sorted(merged.items(), key=lambda kv: kv[0]))
            out[name] = value
        return dataclasses.replace(self, **out)


TUNING = Tuning()


def _half(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def uses_int8(qtype: QType, m: int, n: int, k: int, dtype, tuning: Tuning = TUNING) -> bool:
    """Whether the decode product goes to the int8 kernel: half-precision activations (f32 ones
    keep the exact float kernel), a type and M it wins at, and a weight large enough."""
    if qtype not in int8_formats.TYPES or not _half(dtype) or m > Tuning.get(tuning.int8_max_m, qtype, 0):
        return False
    least = (Tuning.get(tuning.int8_min_values, qtype, 0) if m <= int8.ROUNDS_IN_KERNEL_MAX_M
             else tuning.int8_min_values_rounded_first)
    return n * k >= least


def int8_path(w: QTensor, m: int, dtype, tuning: Tuning = TUNING) -> str | None:
    """"gemv" where a decode product x (m, K) @ w takes the int8 GEMV, else None."""
    return "gemv" if uses_int8(w.qtype, m, *w.shape, dtype, tuning) else None


def reads_words(qtype: QType, n: int, k: int, tuning: Tuning = TUNING) -> bool:
    """Whether a GPU model holds this weight's quant planes as int32 words (gguf_blocks.words),
    which its decode kernels read faster. The float kernel reads Q6_K and Q8_0 words slower, so
    smaller Q6_K weights stay bytes and Q8_0 weights are words only where the wgmma kernel can
    take their batched products; Q4_1's int8 GEMV lost on words. Q4_0 takes words from 2**24
    values, the weights on its int8 GEMV at M=1 (docs/kernels.md, "Quantized products")."""
    least = Tuning.get(tuning.words_min_values, qtype)
    return (least is not None and n * k >= least
            and (qtype != QType.Q8_0 or wgmma.supports_shape(n, k)))


def rounds_x_itself(qtype: QType, m: int, n: int, k: int, tuning: Tuning = TUNING) -> bool:
    """Whether the int8 kernel should be given raw activations (and round them per program)
    rather than a QuantizedX from the kernel before it."""
    return m <= int8.ROUNDS_IN_KERNEL_MAX_M and n * k < Tuning.get(tuning.int8_producer_min_values, qtype, 0)


def default_int8_config(qtype: QType, m: int, n: int, k: int) -> int8.Int8GemvConfig:
    """The int8 kernel's measured tiles; K is split until there are about INT8_PROGRAMS programs.

    One row of Q4_K with K <= 2048 < N: 4 weight rows per program and twice the programs, which
    gained in llama-1b's decode step. Timed alone, the square products gained too, but in the
    model they lost, so they keep the default (docs/kernels.md, "The int8 GEMV")."""
    block_n, values, warps, prefetch = INT8_TILES[qtype]
    programs = INT8_PROGRAMS
    if qtype == QType.Q4_K and m == 1 and k <= 2048 < n:
        block_n, programs = 4, 2 * INT8_PROGRAMS
    block_size = GGML_QUANT_SIZES[qtype][0]
    block_k = max(1, values // block_size)
    n_tiles = -(-n // block_n)
    split = max(1, min(-(-programs // n_tiles), k // block_size // block_k))
    return int8.Int8GemvConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=warps,
                               prefetch=prefetch)


def default_gemv_config(qtype: QType, m: int, n: int, k: int) -> TileConfig:
    """The measured-best decode tiles for this type and M."""
    if m == 1 and qtype in FMA_AT_M1:
        return gemv_config(qtype, m, n, k, method="fma", **FMA_AT_M1[qtype])
    return gemv_config(qtype, m, n, k, programs=PROGRAMS_BY_TYPE.get(qtype, PROGRAMS))


def bf16x2_config(w: QTensor, m: int, dtype, tuning: Tuning = TUNING) -> TileConfig | None:
    """The float kernel's tiles with bf16x2 dequantization for x (m, K) @ w, where it applies
    (2..bf16x2_max_m rows: one row keeps FMA_AT_M1's CUDA-core tiles; a layout with a bf16x2
    tile; bf16 x); None elsewhere."""
    if not (isinstance(w, QTensor) and 2 <= m <= tuning.bf16x2_max_m and supports_bf16x2(w)
            and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)):
        return None
    n, k = w.shape
    return dataclasses.replace(gemv_config(w.qtype, m, n, k, **BF16X2_TILES), dequant="bf16x2")


def uses_wgmma(w: QTensor, m: int, x, interpret: bool, tuning: Tuning = TUNING) -> bool:
    """Whether x (m, K) @ w goes to the wgmma kernel: compiled for the GPU (it has no
    interpreter), wgmma_min_m..wgmma_max_m rows of plain bf16 x, a weight it supports of at
    least wgmma_min_values values."""
    least = Tuning.get(tuning.wgmma_min_values, w.qtype)
    return (not interpret and least is not None and Tuning.get(tuning.wgmma_min_m, w.qtype, 2) <= m <= tuning.wgmma_max_m
            and not isinstance(x, (GatedX, int8.QuantizedX, PendingNorm, NormedRows))
            and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16) and wgmma.supports(w)
            and w.shape[0] * w.shape[1] >= least)


def fma_config(w: QTensor, m: int, dtype, tuning: Tuning = TUNING) -> TileConfig | None:
    """The float kernel's CUDA-core tiles where x (m, K) of `dtype` @ w runs on them (the
    kernel that can apply a PendingNorm or a GatedX), else None."""
    x = jax.ShapeDtypeStruct((m, w.shape[1]), dtype)
    if not 0 < m <= MAX_M or decode_path(x, w, tuning=tuning) != "float" or bf16x2_config(w, m, dtype, tuning):
        return None
    cfg = default_gemv_config(w.qtype, m, *w.shape)
    return cfg if cfg.method == "fma" else None


def pending_norm_config(w: QTensor, m: int, dtype, tuning: Tuning = TUNING) -> TileConfig | None:
    """The tiles of a product that applies a PendingNorm: `fma_config`'s, with the weight rows
    per program doubled while there are more than pending_norm_max_tiles tiles; None off them."""
    cfg = fma_config(w, m, dtype, tuning)
    if cfg is None:
        return None
    n, k = w.shape
    block_n = cfg.block_n
    while -(-n // block_n) > tuning.pending_norm_max_tiles:
        block_n *= 2
    if block_n == cfg.block_n:
        return cfg
    return gemv_config(w.qtype, m, n, k, method="fma", block_n=block_n, programs=FMA_AT_M1[w.qtype]["programs"])


def gemv_config(qtype: QType, m: int, n: int, k: int, *, method: str = "mma", block_n: int = BLOCK_N,
                values_per_step: int = VALUES_PER_STEP, programs: int = PROGRAMS,
                num_warps: int = 4, num_stages: int = 3) -> TileConfig:
    """Tiles for an (m, k) @ (k, n) decode product with an m of at most MAX_M: `programs`
    is the number of programs wanted (K is split until N's tiles times the splits reach it)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv: M={m} outside 1..{MAX_M}")
    block_size = GGML_QUANT_SIZES[qtype][0]
    block_k = max(1, values_per_step // block_size)
    if method == "fma":
        block_m = 1 << (m - 1).bit_length()
    else:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    n_tiles = -(-n // block_n)
    steps = -(-(k // block_size) // block_k)
    split = max(1, min(-(-programs // n_tiles), steps))
    return TileConfig(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split, method=method,
                      num_warps=num_warps, num_stages=num_stages)


def decode_path(x, w: QTensor, *, config: TileConfig | None = None, interpret: bool = False,
                tuning: Tuning = TUNING) -> str:
    """The kernel qmatmul_gemv runs x (M <= 64, K) @ w on: "int8_gemv" (also for any
    QuantizedX x), "wgmma", or "float" (given tiles, or the default ones)."""
    m = x.shape[0]
    if isinstance(x, int8.QuantizedX) or (config is None and int8_path(w, m, x.dtype, tuning)):
        return "int8_gemv"
    if config is None and uses_wgmma(w, m, x, interpret, tuning):
        return "wgmma"
    return "float"


def qmatmul_gemv(x: jax.Array, w: QTensor, *, config: TileConfig | None = None,
                 interpret: bool = False, partials: bool = False, tuning: Tuning = TUNING) -> jax.Array:
    """x (M <= 64, K) @ dequantize(w).T -> (M, N) in x.dtype, on the kernel `decode_path`
    names. With `partials`: the split-K partial sums (S, M, N), float32."""
    m, (n, k) = x.shape[0], w.shape
    path = decode_path(x, w, config=config, interpret=interpret, tuning=tuning)
    cfg = None
    if path == "float":
        cfg = (config or (None if isinstance(x, GatedX) else bf16x2_config(w, m, x.dtype, tuning))
               or default_gemv_config(w.qtype, m, n, k))
    if isinstance(x, NormedRows) and (cfg is None or cfg.method != "mma"):
        x = x.materialize()  # only the tensor-core tiles apply the rows' scale
    if path == "int8_gemv":
        return int8.int8_gemv(x, w, default_int8_config(w.qtype, m, n, k), interpret=interpret,
                              partials=partials)
    if path == "wgmma":
        return wgmma.wgmma_matmul(x, w, partials=partials)
    return fused_qmatmul(x, w, cfg, interpret=interpret, partials=partials)

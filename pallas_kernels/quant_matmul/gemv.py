"""Decode GEMV / skinny GEMM (M = 1..64): each weight byte is read from HBM once per call and
dequantized on chip, by one of four kernels:

- int8_gemv.py: int8-quantized activations and dp4a integer dot products, for half-precision
  activations, the types and row counts where it measured faster (`uses_int8`);
- int8_mma.py: int8-quantized activations on the tensor cores' integer MMA, for Q8_0 and Q4_K
  at more rows than the dp4a kernel takes (`int8_path`);
- wgmma_skinny.py: Q4_K, Q8_0, Q6_K, Q4_0, Q4_1 and Q5_0 against bf16 activations on Hopper's wgmma (Mosaic GPU), the weight
  dequantized straight into the MMA's register operand, from 2 rows up off the int8 kernels
  (`uses_wgmma`);
- kernel.py: the float kernel with one M tile (CUDA-core FMAs or tensor-core MMAs), for
  everything else, and for float32 activations, where it is exact.

Tiles come from `default_int8_config` / `gemv_config`; the measured choices and their
numbers are in benchmarks/NOTES-quant_matmul.md. Small N gets split along K (partial sums
added by XLA) so that every SM has weight to stream.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import GatedX
from pallas_kernels.quant_matmul import int8_gemv as int8
from pallas_kernels.quant_matmul import int8_mma as mma
from pallas_kernels.quant_matmul import wgmma_skinny as wgmma
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.tiles import supports_bf16x2
from pallas_kernels.rms_norm.pending import PendingNorm
from rjax.quant.qtensor import QTensor

MAX_M = 64
# Measured on the H100 (notes). Tensor-core path: 64-row tiles, 256 K values per step, 4
# warps and 320..528 programs (2.4..4 per SM) were fastest; larger tiles or 8 warps lost.
BLOCK_N = 64
VALUES_PER_STEP = 256
PROGRAMS = 320
PROGRAMS_BY_TYPE = {QType.Q4_K: 528}
# At M = 1 the CUDA-core path with small 8..16-row tiles beat the tensor-core path for these
# types (14336x4096: Q8_0 40 vs 45 us, Q6_K 45 vs 64, Q4_0 37 vs 44, Q4_1 41 vs 47, Q5_0 45
# vs 87), and lost for Q4_K (76 vs 53 us).
FMA_AT_M1 = {
    QType.Q8_0: dict(block_n=16, programs=264),
    QType.Q6_K: dict(block_n=16, programs=264),
    QType.Q4_0: dict(block_n=8, programs=264),
    QType.Q4_1: dict(block_n=8, programs=264),
    QType.Q5_0: dict(block_n=16, programs=264),
}


# The int8 kernel (int8_gemv.py) against the float kernel, bf16 activations, M=1, GPU kernel
# time on the H100 (notes): Q4_K 25 vs 52 us at 14336x4096, 4.7 vs 6.4 at 2048x2048; Q8_0 28
# vs 39 and 6.4 vs 7.4. Since no XLA fusions round the activations before it any more (the
# kernel or the norm before it does), it is used for Q4_K and Q8_0 at every size: llama-1b
# decoded 872 tokens/s against 742 with it only from 2**24 values (Q8_0: 808 against 800,
# within noise). For Q4_1 small weights stay on the float kernel (smollm2-135m: 846 with the
# int8 kernel everywhere, 873 from 2**24). Q6_K on bytes measured no faster at layer shapes
# (24.8 vs 24.6 us at 16384x2048); at the output layers, on word planes and 32 x 1024 tiles, it
# is (128256x4096: 213 vs 295 us; session 7), so Q6_K takes it there only.
# Per x row the int8 kernel repeats its dot products, so the float kernel's tensor-core path
# wins beyond some M: for Q4_K on word planes beyond M=4 (x rounded first; 14336x4096: M=3
# 23 vs 50 us, M=4 28 vs 50, M=8 51 vs 51; 16384x2048: M=4 18 vs 27, M=8 31 vs 28), for
# Q8_0 beyond M=8 (M=8: 37 vs 45).
# Q8_0 stops at 4 since session 9: at M=8 it measured 84-95 us against 45-51 for the MMA
# kernels at 14336x4096 and 4096x14336 (37 against 45 in session 3).
INT8_MAX_M = {QType.Q8_0: 4, QType.Q4_K: 4, QType.Q4_1: 4, QType.Q4_0: 4, QType.Q6_K: 1}
INT8_MIN_VALUES = {QType.Q4_K: 0, QType.Q8_0: 0, QType.Q4_1: 2**24, QType.Q4_0: 2**24, QType.Q6_K: 2**27}
# Beyond int8.ROUNDS_IN_KERNEL_MAX_M rows x is rounded in a pass of its own before the product
# (as in session 3, when this threshold was measured for every type): Q8_0 at batch 8
# decoded 2,079 tokens/s (llama-1b) with the kernel rounding 8 rows from 0 values, 2,644
# before on another machine.
INT8_MIN_VALUES_ROUNDED_FIRST = 2**24
# Raw activations are rounded to int8 by the kernel's own programs (no launch, but more kernel
# time); from this many weight values the producer of x rounds them instead (the RMS norm or
# GLU kernel before the product, `takes_quantized_x`). Q4_K on word planes: producer-rounded
# x at every size, in-kernel rounding cost 35% more kernel time at the 8B shapes (15.4 against
# 20.9 us at 14336x4096), and end to end llama-1b decoded 1,090 / 1,132 tokens/s against 1,058 /
# 982 with the 2**25 threshold, llama-8b 337 against 321 (H100, one machine, session 7).
# Q8_0 keeps 2**25 (llama-1b Q8_0 810 tokens/s against 785 from 0, session 4).
INT8_PRODUCER_MIN_VALUES = {QType.Q4_K: 0, QType.Q8_0: 2**25, QType.Q4_1: 2**25, QType.Q4_0: 2**25}
# Down products of up to this many rows are given the GLU's [gate | up] (a GatedX, applied
# by the kernel as it loads x) where they would otherwise multiply act(gate) * up from an XLA
# pass of its own (`takes_gated_x`), where they run on the float kernel's CUDA-core tiles: one
# launch fewer per layer, against every program evaluating the activation for its K range.
# smollm2-135m Q4_1 at batch 1 (H100, notes): 1,202 against 1,200 tokens/s in session 13; with
# the PendingNorm (session 18) 1,295 against 1,239 (2 rounds) and 1,322 against 1,330 (3 rounds,
# 1,256-1,400 between processes), and 658 against 690 us of kernels per step (the multiply's 30
# launches gone, the down product 0.4 us longer).
GATED_X_MAX_M = 1
# Products of up to this many rows on the int8 GEMV whose output goes through the residual
# add and an RMS norm into other int8 products (attention's output projection, the FFN's down
# projection) do that add and norm in their own kernel (`int8_gemv_add_norm`), so that the
# norm kernel between them goes. H100, A/B against the norm kernel (notes, session 11): batch 1
# llama-8b +5.2%, llama-1b Q4_K +3.7%, Q8_0 +1.8%; batch 2 -0.6% and +1.7%; batch 4 -10% and
# -1.4%, where the last program of a group merges and rounds four rows. So one row.
ADD_NORM_MAX_M = 1
# The one-token attention kernel hands its output to an int8 output projection rounded to int8
# (where it merges its splits in the kernel), so that the product does not round it per program.
# 0 turns it off.
QUANTIZED_ATTENTION_OUT = 1
# Gate/up products of up to this many rows whose down product runs on the int8 GEMV apply the
# GLU and round its output for the down product in their own kernel (`int8_gemv_glu`), so
# that the GLU's rounding pass between them goes. 0, so never: a program must hold whole
# 32-value groups of the output, so 64 weight rows, and llama-8b's 14336 groups of gate/up
# rows make 448 programs, 3.4 per SM, against 3,584 of 8 rows. H100, GPU kernel time (notes,
# session 12): 28672x4096 31.3 us against 29.3 for the product and the GLU pass together,
# 16384x2048 10.5 against 10.5, Q8_0 16384x2048 17.7 against 17.2; A/B batch 1, llama-8b
# -4.0%, llama-1b Q4_K +1.6% and Q8_0 -3.2%, both within their rounds' spread.
GLU_MAX_M = 0
# Gate/up products of up to this many rows on the float kernel's CUDA-core tiles (FMA_AT_M1),
# whose down product is on the float kernel too, apply the GLU as they store their rows
# (`fused_qmatmul(..., glu=)`), so that XLA's act(gate) * up pass between them goes. 0, so
# never: smollm2-135m Q4_1 (notes, session 13): the product took 4.7 us against 3.7 + 1.2 for
# the product and the XLA pass, and batch 1 decoded 1,172 against 1,177 tokens/s (1,139 with 8
# gate rows per program), equal within the rounds' spread.
FLOAT_GLU_MAX_M = 0
# Programs that tiling aims for: rows per program are halved while the product has fewer.
FLOAT_GLU_PROGRAMS = 264
# Products of up to this many rows on the float kernel's CUDA-core tiles (FMA_AT_M1) that take
# their x from a residual add + RMS norm are given that add and norm pending (a PendingNorm),
# so that the norm kernel before them goes (`takes_pending_norm`). 0 turns it off.
# Every program of such a product loads x's whole row (the residual, the partial sums, the norm
# weight: float32), so their tiles take more weight rows while there are more than
# PENDING_NORM_MAX_TILES of them. H100, GPU kernel time against the norm kernel + the product
# (notes, session 18): smollm2's q/k/v 960x576 2.57 against 3.60 us, gate/up 3072x576 4.18
# against 4.58 (both at 8 rows); qwen2.5-0.5b's gate/up 9728x896 15.8 at 8 rows, 9.7 at 16,
# 11.1 at 32, against 10.6. One split for every product (each program then sums the row's
# squares from its own loads) lost: q/k/v 5.1 us, smollm2 decoded 0.82x.
PENDING_NORM_MAX_M = 1
PENDING_NORM_MAX_TILES = 640
# Tiles of that kernel: gate rows per program (each with its up row; a multiple of 32, so that
# a program rounds whole groups), values per step, warps, prefetch (best in session 12's sweep).
GLU_TILES = {
    QType.Q4_K: (32, 512, 8, True),
    QType.Q8_0: (32, 256, 4, True),
    QType.Q4_1: (32, 128, 4, False),
    QType.Q4_0: (32, 128, 4, False),
}
INT8_TILES = {  # block_n, values per step, warps, prefetch (measured best at the 8B shapes, notes)
    QType.Q8_0: (8, 512, 4, True),
    QType.Q4_K: (8, 1024, 4, True),    # for Q4_KChunks (packed scales: prefetch 5% slower)
    QType.Q4_1: (32, 256, 4, False),
    QType.Q4_0: (32, 256, 4, False),
    # 128256x4096, scales as words (session 12): 177 us; 32 x 1024: 192 (213 with byte scales),
    # 64 x 512 with 8 warps: 181. 128256x2048: 89 us against 102 (108 with byte scales).
    QType.Q6_K: (32, 512, 4, True),
}
INT8_PROGRAMS = 264
# Rows beyond INT8_MAX_M up to which products go to the int8 MMA kernel (int8_mma.py) instead
# of the float kernel, per type (Q4_K in the GPU layout), under a cap for all types. H100, GPU
# kernel time in us against the float kernel alone (notes, session 9): Q4_K M=8 40.5 vs 51.1 at
# 14336x4096, 44.4 vs 49.5 at 4096x14336, 23.2 vs 28.0 at 16384x2048; M=16 46.6 vs 52.1, 49.2
# vs 51.4, 27.4 vs 29.3; M=32 slower (79.6 vs 55.5). Q8_0 M=8 45.5 vs 47.1, 48.5 vs 51.2, 26.3 vs
# 28.8; M=16 no faster. In a llama-8b batch-8 step the products gained 48 us of 1,896 and the
# int8 rounding of x cost as much (1,883 us of kernels against 1,896), and end to end batch 8
# decoded at the same rate (llama-8b 1,205 both ways, llama-1b Q8_0 4,796 vs 4,789), so the cap
# is 0: the kernel is kept, tested, for the day its per-group scaling gets cheaper.
INT8_MMA_MAX_M = 0
MMA_MAX_M = {QType.Q4_K: 16, QType.Q8_0: 8}
# Products of up to this many rows on the float kernel's tensor-core tiles dequantize Q4_K (in
# the GPU layout), Q4_0 and Q4_1 (bf16 x) with packed bf16x2 instructions (tiles.py) rather than through
# float32, on these tiles: 64 rows, one super-block per step, about 448 programs, 4 warps, 2
# stages. H100, GPU kernel time at M=16 (notes, session 14): 14336x4096 30.8 against 50.0 us,
# 4096x14336 31.5 against 49.3, 6144x4096 16.0 against 23.6, 16384x2048 17.4 against 27.2; end
# to end llama-8b at batch 8 decoded 1,640 against 1,247 tokens/s, smollm2-135m Q4_1 8,687
# against 7,766. 0 turns it off.
BF16X2_MAX_M = MAX_M
BF16X2_TILES = dict(block_n=64, values_per_step=256, programs=448, num_warps=4, num_stages=2)
# Q4_K, Q8_0 and Q6_K products (GPU layout, bf16 x, N a multiple of 64) of up to this many rows off
# the int8 kernel go to the Mosaic GPU wgmma kernel (wgmma_skinny.py) instead of the float
# kernel on the GPU. H100, GPU kernel time at M=16 (notes, sessions 15-16): Q4_K 14336x4096 18.7
# against 30.6 us for bf16x2, 4096x14336 19.5 against 31.4; Q8_0 14336x4096 28.8 against 46.2
# (float32 path), 4096x14336 29.6 against 50.8; Q6_K 4096x14336 26.3 against 65.8, its
# 128256x4096 LM head 177 against 379. 0 turns it off. Smaller weights than
# WGMMA_MIN_VALUES[type] keep the Triton kernel: x's permutation into the kernel's K order is an
# XLA kernel of its own, which cost llama-1b's small Q4_K products what the kernel gained. Q8_0
# takes every size: its Triton path runs 1.7-2.2x its one-row time, not bf16x2's 1.2-2x, and
# llama-1b Q8_0 decoded 2-3% faster with its small products on the kernel (and as words) than
# with both from 2**24 values. Q6_K's Triton path is the float32 one too (2-2.2x its M=1 time).
WGMMA_MAX_M = MAX_M
# Q4_0, Q4_1 and Q5_0 (session 17, M=16): 14336x4096 16.8, 19.3 and 24.7 us against 39.7 and
# 42.4 for bf16x2 and 85.7 for Q5_0's float32 path. Q4_0 and Q4_1 keep Q4_K's threshold (their
# Triton alternative is bf16x2 too), Q5_0 takes every size, as Q8_0.
WGMMA_MIN_VALUES = {QType.Q4_K: 2**24, QType.Q8_0: 0, QType.Q6_K: 0, QType.Q4_0: 2**24, QType.Q4_1: 2**24,
                    QType.Q5_0: 0}
# The fewest rows the wgmma kernel takes, by type. Q6_K from one row (below the int8 GEMV's
# LM-head sizes): one row padded to 16 ran 1.7-2x faster than the CUDA-core FMA tiles (H100,
# session 16: 4096x14336 25.8 against 48.5 us, 4096x4096 8.6 against 15.0, 1024x4096 4.0
# against 7.1); llama-1b q4_k_m (Q6_K attn_v, ffn_down in some layers) decoded at the same rate
# either way at batch 1 (1,064 against 1,053 tokens/s, session 17). Q5_0 from one row too: 28.5
# against 43.4 us for the FMA tiles at 14336x4096, 10.1 against 14.8 at 4096x4096, 3.9 against
# 6.5 at 1024x4096 (session 17, before the kernel's per-block scales were shared in the quad,
# which took 14336x4096 to 24.7).
WGMMA_MIN_M = {QType.Q4_K: 2, QType.Q8_0: 2, QType.Q6_K: 1, QType.Q4_0: 2, QType.Q4_1: 2, QType.Q5_0: 1}
# Weights held as int32 words on the GPU (`reads_words`), from this many values up. Q8_0 where
# the wgmma kernel takes its M > 4 products: its M=1 int8 GEMV ran 3-6% faster on words (H100,
# session 16), the wgmma kernel the same, the float kernel 15-28% slower (session 7).
WORDS_MIN_VALUES = {QType.Q4_K: 0, QType.Q6_K: INT8_MIN_VALUES[QType.Q6_K], QType.Q8_0: 0}


def uses_int8(qtype: QType, m: int, n: int, k: int, dtype) -> bool:
    """Whether the decode product goes to the int8 kernel: half-precision activations (f32 ones
    keep the exact float kernel), a type and M it wins at, and a weight large enough."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and m <= INT8_MAX_M.get(qtype, 0)
            and n * k >= (INT8_MIN_VALUES[qtype] if m <= int8.ROUNDS_IN_KERNEL_MAX_M else INT8_MIN_VALUES_ROUNDED_FIRST))


def int8_path(w: QTensor, m: int, dtype) -> str | None:
    """Which int8 kernel a decode product x (m, K) @ w takes: "gemv" (dp4a, int8_gemv.py),
    "mma" (tensor cores, int8_mma.py), or None (the float kernel)."""
    n, k = w.shape
    if uses_int8(w.qtype, m, n, k, dtype):
        return "gemv"
    if (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and w.qtype in mma.TYPES
            and INT8_MAX_M.get(w.qtype, 0) < m <= min(INT8_MMA_MAX_M, MMA_MAX_M.get(w.qtype, 0)) and mma.supports(w)
            and n * k >= INT8_MIN_VALUES_ROUNDED_FIRST):
        return "mma"
    return None


def default_mma_config(qtype: QType, m: int, n: int, k: int) -> mma.Int8MmaConfig:
    """The int8 MMA kernel's measured tiles (H100, session 9): 64 weight rows per program up to
    8 x rows, 128 beyond; one Q4_K super-block or four Q8_0 blocks per step (more lost); K split
    until there are about 448 programs (336 beyond 8 rows)."""
    block_n, programs = (64, 448) if m <= 8 else (128, 336)
    block_size = GGML_QUANT_SIZES[qtype][0]
    block_k = 1 if block_size == 256 else 4
    split = max(1, min(-(-programs // -(-n // block_n)), k // block_size // block_k))
    return mma.Int8MmaConfig(block_n=block_n, block_k=block_k, split_k=split)


def reads_words(qtype: QType, n: int, k: int) -> bool:
    """Whether a GPU model holds this weight's quant planes as int32 words (rjax.quant.words),
    which its decode kernels read faster. H100, per product (notes, session 7): Q4_K's int8
    GEMV ran 1.26-1.42x faster on words, its float kernel (M > 4) 1-8% slower; Q6_K's int8
    GEMV (output layers) gained up to 16%, its float kernel lost 45% at M=1 (so smaller Q6_K
    weights stay bytes); Q8_0's int8 GEMV gained 7-11% but its float kernel lost 15-28% (so
    Q8_0 weights are words only where the wgmma kernel can take their M > 4 products), and Q4_1's
    int8 GEMV lost 30%. WORDS_MIN_VALUES has the sizes."""
    return (qtype in WORDS_MIN_VALUES and n * k >= WORDS_MIN_VALUES[qtype]
            and (qtype != QType.Q8_0 or wgmma.supports_shape(n, k)))


def rounds_x_itself(qtype: QType, m: int, n: int, k: int) -> bool:
    """Whether the int8 kernel should be given raw activations (and round them per program)
    rather than a QuantizedX from the kernel before it."""
    return m <= int8.ROUNDS_IN_KERNEL_MAX_M and n * k < INT8_PRODUCER_MIN_VALUES.get(qtype, 0)


def default_int8_config(qtype: QType, m: int, n: int, k: int) -> int8.Int8GemvConfig:
    """The int8 kernel's measured tiles; K is split until there are about INT8_PROGRAMS programs.

    One row of Q4_K with K <= 2048 < N: 4 weight rows per program and twice the programs. H100,
    us per product in llama-1b's decode step (profile_decode.py, session 10): 3072x2048 3.2 vs
    3.6, 16384x2048 8.7 vs 9.4. Alone (benchmarks/int8_gemv_tiles.py) the square products gained
    too (4096x4096 5.6 vs 6.0), but in the model they lost (9.8 vs 7.5 us at llama-8b, 3.5 vs
    3.3 at llama-1b), so they keep the default."""
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


def default_glu_config(qtype: QType, m: int, n: int, k: int) -> int8.Int8GemvConfig:
    """Tiles of the gate/up product that applies the GLU (`int8_gemv_glu`), w (n = 2F, k)."""
    block_n, values, warps, prefetch = GLU_TILES[qtype]
    block_k = max(1, values // GGML_QUANT_SIZES[qtype][0])
    return int8.Int8GemvConfig(block_n=block_n, block_k=block_k, split_k=1, num_warps=warps, prefetch=prefetch)


def float_glu_config(qtype: QType, m: int, n: int, k: int) -> TileConfig | None:
    """Tiles for the float kernel's gate/up product that applies the GLU (n = 2F rows): the
    type's CUDA-core tiles at M=1, with one split (the activation needs whole sums), and rows
    per program halved while there are fewer than FLOAT_GLU_PROGRAMS programs. None where the
    product is not on CUDA-core tiles."""
    if m != 1 or qtype not in FMA_AT_M1:
        return None
    tiles = FMA_AT_M1[qtype]
    block_n = tiles["block_n"]
    while block_n > 1 and -(-(n // 2) // block_n) < FLOAT_GLU_PROGRAMS:
        block_n //= 2
    cfg = gemv_config(qtype, m, n // 2, k, method="fma", block_n=block_n, programs=1)
    return dataclasses.replace(cfg, split_k=1)


def default_gemv_config(qtype: QType, m: int, n: int, k: int) -> TileConfig:
    """The measured-best decode tiles for this type and M."""
    if m == 1 and qtype in FMA_AT_M1:
        return gemv_config(qtype, m, n, k, method="fma", **FMA_AT_M1[qtype])
    return gemv_config(qtype, m, n, k, programs=PROGRAMS_BY_TYPE.get(qtype, PROGRAMS))


def bf16x2_config(w: QTensor, m: int, dtype) -> TileConfig | None:
    """The float kernel's tiles with bf16x2 dequantization for x (m, K) @ w, where it applies
    (2..BF16X2_MAX_M rows: one row keeps FMA_AT_M1's CUDA-core tiles; a layout with a bf16x2
    tile; bf16 x); None elsewhere."""
    if not (isinstance(w, QTensor) and 2 <= m <= BF16X2_MAX_M and supports_bf16x2(w)
            and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)):
        return None
    n, k = w.shape
    return dataclasses.replace(gemv_config(w.qtype, m, n, k, **BF16X2_TILES), dequant="bf16x2")


def uses_wgmma(w: QTensor, m: int, x, interpret: bool) -> bool:
    """Whether x (m, K) @ w goes to the wgmma kernel: compiled for the GPU (it has no
    interpreter), WGMMA_MIN_M..WGMMA_MAX_M rows of plain bf16 x, a weight it supports of at
    least WGMMA_MIN_VALUES values."""
    return (not interpret and WGMMA_MIN_M.get(w.qtype, 2) <= m <= WGMMA_MAX_M
            and not isinstance(x, (GatedX, int8.QuantizedX, PendingNorm))
            and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16) and wgmma.supports(w)
            and w.shape[0] * w.shape[1] >= WGMMA_MIN_VALUES[w.qtype])


def fma_config(w: QTensor, m: int, dtype) -> TileConfig | None:
    """The float kernel's CUDA-core tiles where x (m, K) of `dtype` @ w runs on them (the
    kernel that can apply a PendingNorm), else None."""
    x = jax.ShapeDtypeStruct((m, w.shape[1]), dtype)
    if not 0 < m <= MAX_M or decode_path(x, w) != "float" or bf16x2_config(w, m, dtype) is not None:
        return None
    cfg = default_gemv_config(w.qtype, m, *w.shape)
    return cfg if cfg.method == "fma" else None


def pending_norm_config(w: QTensor, m: int, dtype) -> TileConfig | None:
    """The tiles of a product that applies a PendingNorm: `fma_config`'s, with the weight rows
    per program doubled while there are more than PENDING_NORM_MAX_TILES tiles; None off them."""
    cfg = fma_config(w, m, dtype)
    if cfg is None:
        return None
    n, k = w.shape
    block_n = cfg.block_n
    while -(-n // block_n) > PENDING_NORM_MAX_TILES:
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


def decode_path(x, w: QTensor, *, config: TileConfig | None = None, interpret: bool = False) -> str:
    """The kernel qmatmul_gemv runs x (M <= 64, K) @ w on: "int8_mma", "int8_gemv" (also for
    any QuantizedX x), "wgmma", or "float" (given tiles, or the default ones)."""
    m = x.shape[0]
    path = None if config is not None else int8_path(w, m, x.dtype)
    if path == "mma":
        return "int8_mma"
    if path == "gemv" or isinstance(x, int8.QuantizedX):
        return "int8_gemv"
    if config is None and uses_wgmma(w, m, x, interpret):
        return "wgmma"
    return "float"


def qmatmul_gemv(x: jax.Array, w: QTensor, *, config: TileConfig | None = None,
                 interpret: bool = False, partials: bool = False) -> jax.Array:
    """x (M <= 64, K) @ dequantize(w).T -> (M, N) in x.dtype, on the kernel `decode_path`
    names. With `partials`: the split-K partial sums (S, M, N), float32."""
    m, (n, k) = x.shape[0], w.shape
    path = decode_path(x, w, config=config, interpret=interpret)
    if path == "int8_mma":
        if isinstance(x, int8.QuantizedX) and x.ss is not None:
            x = int8.dequantize_x(x).astype(x.dtype)  # the MMA kernel has no pending-norm scaling
        return mma.int8_mma(x, w, default_mma_config(w.qtype, m, n, k), interpret=interpret, partials=partials)
    if path == "int8_gemv":
        return int8.int8_gemv(x, w, default_int8_config(w.qtype, m, n, k), interpret=interpret,
                              partials=partials)
    if path == "wgmma":
        return wgmma.wgmma_matmul(x, w, partials=partials)
    cfg = (config or (None if isinstance(x, GatedX) else bf16x2_config(w, m, x.dtype))
           or default_gemv_config(w.qtype, m, n, k))
    return fused_qmatmul(x, w, cfg, interpret=interpret, partials=partials)

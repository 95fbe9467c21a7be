"""Decode GEMV / skinny GEMM (M = 1..64): the fused kernel with one M tile, so each weight
byte is read from HBM once per call and dequantized in registers.

Tiles come from `gemv_config`; the measured choices and their numbers are in
benchmarks/NOTES-quant_matmul.md. Small N gets split along K (partial sums added by XLA)
so that every SM has weight to stream.
"""
from __future__ import annotations

import jax
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
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


def default_gemv_config(qtype: QType, m: int, n: int, k: int) -> TileConfig:
    """The measured-best decode tiles for this type and M."""
    if m == 1 and qtype in FMA_AT_M1:
        return gemv_config(qtype, m, n, k, method="fma", **FMA_AT_M1[qtype])
    return gemv_config(qtype, m, n, k, programs=PROGRAMS_BY_TYPE.get(qtype, PROGRAMS))


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


def qmatmul_gemv(x: jax.Array, w: QTensor, *, config: TileConfig | None = None,
                 interpret: bool = False) -> jax.Array:
    """x (M <= 64, K) @ dequantize(w).T -> (M, N) in x.dtype."""
    cfg = config or default_gemv_config(w.qtype, x.shape[0], *w.shape)
    return fused_qmatmul(x, w, cfg, interpret=interpret)

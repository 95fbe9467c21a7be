"""Prefill GEMM (M in the hundreds to thousands): either the fused kernel with large tiles
(dequantize each weight tile in registers, bf16 MMA on the tensor cores) or dequantize the
whole weight once and use XLA's dot, whichever measured faster for the type
(docs/kernels.md).
"""
from __future__ import annotations

import dataclasses

import jax
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.reference import dequantize_then_dot
from gguf_blocks.formats import Q4_KChunks
from gguf_blocks.qtensor import QTensor

PATHS = ("fused", "dequant_dot")
# Dequantize + XLA's bf16 dot outran the fused kernel at every measured M (docs/kernels.md,
# "Tried and not kept"). The fused kernel is used below FUSED_MAX_M rows, where the fixed cost
# of writing the dequantized weight weighs more.
FUSED_MAX_M = 0


def prefill_path(qtype: QType, m: int, n: int, k: int) -> str:
    return "fused" if m < FUSED_MAX_M else "dequant_dot"


def gemm_config(qtype: QType, m: int, n: int, k: int) -> TileConfig:
    """Tiles for the fused prefill kernel: 128x128 output tiles, 64 (32-blocks) or 256 K
    values per step; 4 warps for 32-value blocks, 8 for super-blocks (fastest measured)."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    block_k = max(1, 64 // block_size)
    return TileConfig(block_m=128, block_n=128, block_k=block_k, num_warps=8 if block_size == 256 else 4,
                      num_stages=3)


def qmatmul_gemm(x: jax.Array, w: QTensor, *, path: str | None = None,
                 config: TileConfig | None = None, interpret: bool = False) -> jax.Array:
    """x (M, K) @ dequantize(w).T -> (M, N) in x.dtype, by the measured-faster path."""
    path = path or prefill_path(w.qtype, x.shape[0], *w.shape)
    if path == "dequant_dot":
        return dequantize_then_dot(x, w)
    if path != "fused":
        raise ValueError(f"qmatmul_gemm: path={path!r}; expected one of {PATHS}")
    cfg = config or gemm_config(w.qtype, x.shape[0], *w.shape)
    if config is None and isinstance(w.planes, Q4_KChunks):
        # Its scale words are one more pipelined plane: 3 stages asked 233,472 bytes of shared
        # memory on the H100, 1 KiB over the limit.
        cfg = dataclasses.replace(cfg, num_stages=2)
    return fused_qmatmul(x, w, cfg, interpret=interpret)

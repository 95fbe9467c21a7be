"""Quantized matmul over GGUF planes: fused Pallas kernels with a pure-JAX reference.

    qmatmul(x, w, *, implementation=None) -> x @ dequantize(w).T    x: (..., K), w: QTensor (N, K)
    qmatmul(x, w, partials=True) -> (S, ..., N) float32 partial sums of that product (S >= 1):
        a split-K decode kernel's unsummed output, for a consumer that adds them in its own pass
    qmatmul_add_norm(x, w, residual, norm_w, eps, counts, out_dtype, rows=False) -> (residual +
        x @ w.T, rms_norm(that) * norm_w with the norm's scale pending, counts): the residual
        add and the norm between two decode products done by the first one's kernel; the
        normed rows as a QuantizedX (two int8 GEMVs) or with rows=True a NormedRows (the float
        kernel's tensor-core tiles)
    qmatmul_pending_norm(x, w, partials=False) -> (x @ w.T for the normed rows of the
        PendingNorm x, the summed residual)

x may be a plain array, a QuantizedX (rounded to int8 by its producer), a GatedX (a GLU's
[gate | up], applied by the kernel as it loads x), a NormedRows (normed rows whose scale the
kernel applies to its sums) or, for qmatmul_pending_norm, a PendingNorm.
Which kernel takes a product, and which of those inputs it takes, is answered for a product's
shape, type, dtype and backend by `kernel_for` and the `takes_*` / `fuses_add_norm` questions,
from a `Tuning` (gemv.py); a model's plan (rjax.math.plan) asks them once and its ops follow.

`implementation`: None picks the kernels on a GPU backend for supported types (the decode
GEMV for M <= 64 rows, the prefill GEMM above) and the reference elsewhere; "reference",
"pallas" (the kernels, compiled) and "interpret" (the kernels in Pallas' CPU interpreter)
force one. The result has x's dtype; accumulation is float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import GatedX, QuantizedX, dequantize_x, quantize_normed
from pallas_kernels.quant_matmul import gemv
from pallas_kernels.quant_matmul.gemm import qmatmul_gemm
from pallas_kernels.quant_matmul.gemv import MAX_M, TUNING, Tuning, default_int8_config, qmatmul_gemv
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv_add_norm
from pallas_kernels.quant_matmul.kernel import fused_qmatmul, fused_qmatmul_add_norm
from pallas_kernels.quant_matmul.reference import qmatmul_reference
from pallas_kernels.quant_matmul.tiles import FORMATS
from pallas_kernels.rms_norm.pending import NormedRows, PendingNorm
from gguf_blocks.qtensor import QTensor

IMPLEMENTATIONS = ("reference", "pallas", "interpret")

__all__ = ["qmatmul", "qmatmul_add_norm", "qmatmul_pending_norm", "supports", "kernel_for", "takes_quantized_x",
           "takes_gated_x", "takes_pending_norm", "fuses_add_norm", "fuses_add_norm_rows", "runs_int8_gemv", "Tuning", "TUNING",
           "IMPLEMENTATIONS", "MAX_M"]


def supports(qtype: QType) -> bool:
    """Whether the fused kernels handle this GGML type."""
    return qtype in FORMATS


def _on_gpu(gpu: bool | None) -> bool:
    return jax.default_backend() == "gpu" if gpu is None else gpu


def _decode_product(w, rows: int, gpu: bool | None) -> bool:
    """A product the decode kernels take on this backend: a supported quantized weight, 1..MAX_M rows."""
    return isinstance(w, QTensor) and _on_gpu(gpu) and supports(w.qtype) and 0 < rows <= MAX_M


def kernel_for(w, rows: int, dtype, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> str:
    """The kernel x (rows, K) of `dtype` @ w runs on: "dense" (a plain weight: XLA's dot),
    "reference" (dequantize, then XLA's dot), "gemm" (the prefill kernel), or a decode kernel:
    "int8_gemv", "wgmma", "float" (CUDA-core or tensor-core tiles) or "bf16x2"."""
    if not isinstance(w, QTensor):
        return "dense"
    if not (_on_gpu(gpu) and supports(w.qtype)):
        return "reference"
    if rows > MAX_M:
        return "gemm"
    path = gemv.decode_path(jax.ShapeDtypeStruct((rows, w.shape[1]), dtype), w, tuning=tuning)
    if path == "float" and gemv.bf16x2_config(w, rows, dtype, tuning) is not None:
        return "bf16x2"
    return path


def runs_int8_gemv(w, rows: int, dtype, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> bool:
    """Whether x (rows, K) @ w runs on the int8 decode GEMV, which multiplies x rounded to int8:
    a producer that can round it at no extra launch should hand it over as a QuantizedX."""
    return _decode_product(w, rows, gpu) and gemv.int8_path(w, rows, dtype, tuning) == "gemv"


def takes_quantized_x(w, rows: int, dtype, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> bool:
    """Whether x (rows, K) @ w wants x rounded to int8 by its producer (the norm or GLU kernel
    before it): on the int8 GEMV, and large enough that the product should not round x per
    program itself."""
    return (runs_int8_gemv(w, rows, dtype, gpu=gpu, tuning=tuning)
            and not gemv.rounds_x_itself(w.qtype, rows, *w.shape, tuning))


def takes_gated_x(w, rows: int, dtype, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> bool:
    """Whether the FFN's down product x (rows, K) @ w should be given the GLU's [gate | up] (a
    GatedX, applied by the kernel as it loads x): on the float kernel's CUDA-core tiles, for at
    most tuning.gated_x_max_m rows."""
    return (_decode_product(w, rows, gpu) and rows <= tuning.gated_x_max_m
            and gemv.fma_config(w, rows, dtype, tuning) is not None)


def takes_pending_norm(w, rows: int, dtype, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> bool:
    """Whether x (rows, K) @ w, where x is the residual stream RMS-normed, should be given the
    add + norm pending (a PendingNorm), which its kernel applies: on the float kernel's
    CUDA-core tiles, for at most tuning.pending_norm_max_m rows."""
    return (_decode_product(w, rows, gpu) and rows <= tuning.pending_norm_max_m
            and gemv.fma_config(w, rows, dtype, tuning) is not None)


def fuses_add_norm(w, rows: int, dtype, consumers, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> bool:
    """Whether x (rows, K) @ w, then the residual add and an RMS norm whose output feeds the
    products `consumers`, can run as one kernel (`qmatmul_add_norm`): on the int8 decode GEMV
    for w and for every consumer (which take the normed rows rounded to int8), for at most
    tuning.add_norm_max_m rows, with tiles that cover whole 32-row groups."""
    kw = dict(gpu=gpu, tuning=tuning)
    if not (runs_int8_gemv(w, rows, dtype, **kw) and rows <= tuning.add_norm_max_m and w.shape[0] % 32 == 0
            and 32 % default_int8_config(w.qtype, rows, *w.shape).block_n == 0):
        return False
    return bool(consumers) and all(runs_int8_gemv(c, rows, dtype, **kw) for c in consumers)


def _rows_tiles(w, rows: int, dtype, tuning: Tuning):
    """The float kernel's tensor-core tiles x (rows, K) @ w runs on (bf16x2 or not)."""
    return gemv.bf16x2_config(w, rows, dtype, tuning) or gemv.default_gemv_config(w.qtype, rows, *w.shape)


def fuses_add_norm_rows(w, rows: int, dtype, consumers, *, gpu: bool | None = None, tuning: Tuning = TUNING) -> bool:
    """Whether x (rows, K) @ w, then the residual add and an RMS norm whose output feeds the
    products `consumers`, can run as one kernel handing over a NormedRows
    (`qmatmul_add_norm(rows=True)`): on the float kernel's tensor-core tiles for w and for every
    consumer (which apply the norm's scale), for 2..tuning.rows_add_norm_max_m rows in one M
    tile, N and the tiles' rows whole 32-value groups."""
    kw = dict(gpu=gpu, tuning=tuning)

    def on_tiles(v):
        return _decode_product(v, rows, gpu) and kernel_for(v, rows, dtype, **kw) in ("float", "bf16x2")

    if not (2 <= rows <= tuning.rows_add_norm_max_m and consumers and on_tiles(w) and w.shape[0] % 32 == 0):
        return False
    cfg = _rows_tiles(w, rows, dtype, tuning)
    return (cfg.method == "mma" and cfg.block_n % 32 == 0 and rows <= cfg.block_m
            and all(on_tiles(c) and c.shape[1] % 32 == 0 for c in consumers))


def _check_implementation(implementation: str | None, w: QTensor) -> str:
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" and supports(w.qtype) else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"qmatmul: implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    return implementation


def qmatmul_add_norm(x: jax.Array | QuantizedX, w: QTensor, residual: jax.Array, norm_w: jax.Array, eps: float,
                     counts: jax.Array, out_dtype, *, rows: bool = False, implementation: str | None = None,
                     tuning: Tuning = TUNING):
    """residual (..., N) + x (..., K) @ dequantize(w).T, and rms_norm of that sum times norm_w
    with the norm's scale pending, in the product's kernel: rounded to int8 (a QuantizedX with
    `ss`, which the int8 kernels and `dequantize_x` apply) by the int8 GEMV, or with `rows` in
    out_dtype (a NormedRows) by the float kernel's tensor-core tiles. counts (N / 32,) int32
    zeros, handed back zeroed. -> (new residual float32, normed rows, counts)."""
    implementation = _check_implementation(implementation, w)
    n, k = w.shape
    lead = residual.shape[:-1]
    m = math.prod(lead)
    if implementation == "reference":
        if isinstance(x, (GatedX, NormedRows)):
            plain = x.materialize()
        else:
            plain = dequantize_x(x).astype(x.dtype) if isinstance(x, QuantizedX) else x
        x_out = residual + qmatmul_reference(plain.reshape(m, k), w).astype(jnp.float32).reshape(residual.shape)
        if rows:
            ss = jnp.sum(jnp.square(x_out).reshape(*lead, n // 32, 32), axis=-1)
            return x_out, NormedRows((x_out * norm_w).astype(out_dtype), ss, float(eps)), counts
        return x_out, quantize_normed(x_out, norm_w, eps, out_dtype), counts
    if rows:
        x_out, normed, counts = fused_qmatmul_add_norm(
            x.reshape(m) if isinstance(x, (GatedX, NormedRows)) else x.reshape(m, k), w,
            _rows_tiles(w, m, out_dtype, tuning), residual.reshape(m, n), norm_w, counts, float(eps),
            interpret=implementation == "interpret")
        return x_out.reshape(residual.shape), normed.reshape(*lead), counts
    x2 = x.reshape(m) if isinstance(x, QuantizedX) else x.reshape(m, k)
    x_out, xq, counts = int8_gemv_add_norm(x2, w, residual.reshape(m, n), norm_w, counts,
                                           default_int8_config(w.qtype, m, n, k), eps, out_dtype,
                                           interpret=implementation == "interpret")
    return x_out.reshape(residual.shape), xq.reshape(*lead), counts


def qmatmul_pending_norm(x: PendingNorm, w: QTensor, *, partials: bool = False, implementation: str | None = None,
                         tuning: Tuning = TUNING):
    """(rms_norm(x.residual + sum(x.parts)) * x.weight @ dequantize(w).T, x.residual +
    sum(x.parts)): the product (..., N) in x.dtype, or with `partials` its partial sums, and the
    new residual (..., K) float32. On the float kernel's CUDA-core tiles in one kernel where
    the implementation has them, else materialized first."""
    implementation = _check_implementation(implementation, w)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    cfg = (gemv.pending_norm_config(w, rows, x.dtype, tuning)
           if implementation != "reference" and supports(w.qtype) and 0 < rows <= MAX_M else None)
    if cfg is None:
        residual, normed = x.materialize(implementation)
        return qmatmul(normed, w, implementation=implementation, partials=partials, tuning=tuning), residual
    out, residual = fused_qmatmul(x.reshape(rows), w, cfg, interpret=implementation == "interpret",
                                  partials=partials)
    return out.reshape(*out.shape[:-2], *lead, w.shape[0]), residual.reshape(x.shape)


def qmatmul(x: jax.Array | QuantizedX | GatedX, w: QTensor, *, implementation: str | None = None,
            partials: bool = False, tuning: Tuning = TUNING) -> jax.Array:
    """x (..., K) @ dequantize(w).T with w of logical shape (N, K) -> (..., N) in x.dtype, or
    with `partials` its S partial sums (S, ..., N) in float32."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"qmatmul: x of shape {x.shape} does not match weight {w.qtype.name} of shape {w.shape}")
    implementation = _check_implementation(implementation, w)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    decode = implementation != "reference" and 0 < rows <= MAX_M and supports(w.qtype)
    if isinstance(x, (GatedX, NormedRows)) and not decode:
        x = x.materialize()
    if isinstance(x, (GatedX, NormedRows)):
        x2 = x.reshape(rows)
    elif isinstance(x, QuantizedX):
        x2 = x.reshape(rows)
        if not decode or gemv.int8_path(w, rows, x.dtype, tuning) is None:
            x2 = dequantize_x(x2).astype(x.dtype)
    else:
        x2 = x.reshape(rows, k)
    if implementation != "reference" and rows and not supports(w.qtype):
        raise NotImplementedError(
            f"qmatmul: no fused kernel for {w.qtype.name}; supported: {', '.join(t.name for t in FORMATS)}")
    interpret = implementation == "interpret"
    if decode:
        out = qmatmul_gemv(x2, w, interpret=interpret, partials=partials, tuning=tuning)
        return out.reshape(*out.shape[:-2], *lead, n)
    if implementation == "reference" or rows == 0:
        out = qmatmul_reference(x2, w)
    else:
        # The interpreter always runs the fused kernel, so CPU tests cover its code.
        out = qmatmul_gemm(x2, w, path="fused" if interpret else None, interpret=interpret)
    out = out.reshape(*lead, n)
    return out[None].astype(jnp.float32) if partials else out

"""Quantized matmul over GGUF planes: fused Pallas kernels with a pure-JAX reference.

    qmatmul(x, w, *, implementation=None) -> x @ dequantize(w).T    x: (..., K), w: QTensor (N, K)
    qmatmul(x, w, partials=True) -> (S, ..., N) float32 partial sums of that product (S >= 1):
        a split-K decode kernel's unsummed output, for a consumer that adds them in its own pass
    qmatmul_add_norm(x, w, residual, norm_w, eps, counts, out_dtype) -> (residual + x @ w.T,
        rms_norm(that) * norm_w as a QuantizedX with the norm pending, counts): the residual
        add and the norm between two int8 decode products done by the first one's kernel
    qmatmul_pending_norm(x, w, partials=False) -> (x @ w.T for the normed rows of the
        PendingNorm x, the summed residual)

x may be a plain array, a QuantizedX (rounded to int8 by its producer), a GatedX (a GLU's
[gate | up], applied by the kernel as it loads x) or, for qmatmul_pending_norm, a PendingNorm.
Which kernel takes a product, and which of those inputs it takes, is answered for a product's
shape, type, dtype and backend by `kernel_for` and the `takes_*` / `fuses_add_norm` questions,
from a `Tuning` (gemv.py); a model's plan (rjax.plan) asks them once and its ops follow.

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
from pallas_kernels.quant_matmul.kernel import fused_qmatmul
from pallas_kernels.quant_matmul.reference import qmatmul_reference
from pallas_kernels.quant_matmul.tiles import FORMATS
from pallas_kernels.rms_norm.pending import PendingNorm
from gguf_blocks.qtensor import QTensor

IMPLEMENTATIONS = ("reference", "pallas", "interpret")

__all__ = ["qmatmul", "qmatmul_add_norm", "qmatmul_pending_norm", "supports", "kernel_for", "takes_quantized_x",
           "takes_gated_x", "takes_pending_norm", "fuses_add_norm", "runs_int8_gemv", "Tuning", "TUNING",
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


def _check_implementation(implementation: str | None, w: QTensor) -> str:
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" and supports(w.qtype) else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"qmatmul: implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    return implementation


def qmatmul_add_norm(x: jax.Array | QuantizedX, w: QTensor, residual: jax.Array, norm_w: jax.Array, eps: float,
                     counts: jax.Array, out_dtype, *, implementation: str | None = None):
    """residual (..., N) + x (..., K) @ dequantize(w).T, and rms_norm of that sum times norm_w
    rounded to int8 with the norm's scale pending (a QuantizedX with `ss`, which the int8
    kernels and `dequantize_x` apply), in the product's kernel; counts (N / 32,) int32 zeros,
    handed back zeroed. -> (new residual float32, normed QuantizedX, counts)."""
    implementation = _check_implementation(implementation, w)
    n, k = w.shape
    lead = residual.shape[:-1]
    rows = math.prod(lead)
    if implementation == "reference":
        plain = dequantize_x(x).astype(x.dtype) if isinstance(x, QuantizedX) else x
        x_out = residual + qmatmul_reference(plain.reshape(rows, k), w).astype(jnp.float32).reshape(residual.shape)
        return x_out, quantize_normed(x_out, norm_w, eps, out_dtype), counts
    x2 = x.reshape(rows) if isinstance(x, QuantizedX) else x.reshape(rows, k)
    x_out, xq, counts = int8_gemv_add_norm(x2, w, residual.reshape(rows, n), norm_w, counts,
                                           default_int8_config(w.qtype, rows, n, k), eps, out_dtype,
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
    if isinstance(x, GatedX) and not decode:
        x = x.materialize()
    if isinstance(x, GatedX):
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

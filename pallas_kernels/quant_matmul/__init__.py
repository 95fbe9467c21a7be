"""Quantized matmul over GGUF planes: fused Pallas kernels with a pure-JAX reference.

    qmatmul(x, w, *, implementation=None) -> x @ dequantize(w).T    x: (..., K), w: QTensor (N, K)
    qmatmul(x, w, partials=True) -> (S, ..., N) float32 partial sums of that product (S >= 1):
        a split-K decode kernel's unsummed output, for a consumer that adds them in its own pass
    supports(qtype) -> bool                                        a fused kernel exists
    takes_quantized_x(w, rows, dtype) -> bool   the product would run on int8 activations and
        is large enough that their producer should hand them over already rounded (a
        QuantizedX); any other x is rounded by the int8 kernel itself, and a QuantizedX given
        to a float path is expanded
    takes_gated_x(w, rows, dtype) -> bool       the FFN's down product should be given the
        GLU's [gate | up] (a GatedX), which the decode kernels apply as they load x; any
        other path multiplies its materialized act(gate) * up
    qmatmul_add_norm(x, w, residual, norm_w, eps, counts, out_dtype) -> (residual + x @ w.T,
        rms_norm(that) * norm_w as a QuantizedX with the norm pending, counts): the residual
        add and the norm between two decode products done by the first one's kernel, where
        `fuses_add_norm` says so
    takes_pending_norm(w, rows, dtype) -> bool  the product should be given the residual add +
        RMS norm before it pending (a PendingNorm), which its decode kernel applies
    qmatmul_pending_norm(x, w, partials=False) -> (x @ w.T for the normed rows of the
        PendingNorm x, the summed residual): on the kernel where `takes_pending_norm` says
        so, else the add + norm kernel, then the product
    qmatmul_glu(x, w, activation, out_dtype) -> act(x @ gate.T) * (x @ up.T) for w = [gate; up],
        rounded to int8 (a QuantizedX) for the int8 GEMV or in x's dtype for the float kernel:
        the FFN's GLU done by the gate/up product's kernel, where `fuses_glu` says so

`implementation`: None picks the kernels on a GPU backend for supported types (the decode
GEMV for M <= 64 rows, the prefill GEMM above) and the reference elsewhere; "reference",
"pallas" (the kernels, compiled) and "interpret" (the kernels in Pallas' CPU interpreter)
force one. The result has x's dtype; accumulation is float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import GatedX, QuantizedX, dequantize_x
from pallas_kernels.quant_matmul import gemv
from pallas_kernels.quant_matmul.gemm import qmatmul_gemm
from pallas_kernels.quant_matmul.gemv import MAX_M, default_int8_config, int8_path, qmatmul_gemv, rounds_x_itself
from pallas_kernels.quant_matmul.int8_gemv import int8_gemv_add_norm, int8_gemv_glu
from pallas_kernels.quant_matmul.kernel import fused_qmatmul
from pallas_kernels.quant_matmul.reference import qmatmul_reference
from pallas_kernels.quant_matmul.tiles import FORMATS
from pallas_kernels.rms_norm.pending import PendingNorm
from rjax.quant.qtensor import QTensor

IMPLEMENTATIONS = ("reference", "pallas", "interpret")


def supports(qtype: QType) -> bool:
    """Whether the fused kernels handle this GGML type."""
    return qtype in FORMATS


def takes_gated_x(w, rows: int, dtype) -> bool:
    """Whether the FFN's down product x (rows, K) @ w should be given x as the GLU's
    [gate | up] (a GatedX, its GLU applied by the decode kernel as it loads x) rather than
    act(gate) * up from a pass of its own: on this backend's float decode kernel's CUDA-core
    tiles (the wgmma kernel takes plain x only), for at most gemv.GATED_X_MAX_M rows."""
    return (isinstance(w, QTensor) and jax.default_backend() == "gpu" and supports(w.qtype)
            and 0 < rows <= min(MAX_M, gemv.GATED_X_MAX_M) and gemv.fma_config(w, rows, dtype) is not None)


def takes_quantized_x(w, rows: int, dtype) -> bool:
    """Whether x (rows, K) @ w would go to the int8 decode kernel on this backend."""
    return (isinstance(w, QTensor) and jax.default_backend() == "gpu" and supports(w.qtype)
            and 0 < rows <= MAX_M and int8_path(w, rows, dtype) is not None
            and not rounds_x_itself(w.qtype, rows, *w.shape))


def runs_int8_gemv(w, rows: int, dtype) -> bool:
    """Whether x (rows, K) @ w runs on this backend's int8 decode GEMV, which multiplies x rounded
    to int8: a producer that can round it at no extra launch should hand it over as a QuantizedX."""
    return (isinstance(w, QTensor) and jax.default_backend() == "gpu" and supports(w.qtype)
            and 0 < rows <= MAX_M and int8_path(w, rows, dtype) == "gemv")


def fuses_add_norm(w, rows: int, dtype, consumers) -> bool:
    """Whether x (rows, K) @ w, then the residual add and an RMS norm whose output feeds the
    products `consumers`, can run as one kernel (`qmatmul_add_norm`): on this backend's int8
    decode GEMV for w and for every consumer (which take the normed rows rounded to int8), for
    at most gemv.ADD_NORM_MAX_M rows, with tiles that cover whole 32-row groups."""
    if not (runs_int8_gemv(w, rows, dtype) and rows <= gemv.ADD_NORM_MAX_M and w.shape[0] % 32 == 0
            and 32 % default_int8_config(w.qtype, rows, *w.shape).block_n == 0):
        return False
    consumers = [c for c in consumers if c is not None]
    return bool(consumers) and all(runs_int8_gemv(c, rows, dtype) for c in consumers)


def qmatmul_add_norm(x: jax.Array | QuantizedX, w: QTensor, residual: jax.Array, norm_w: jax.Array, eps: float,
                     counts: jax.Array, out_dtype, *, interpret: bool = False):
    """residual (..., N) + x (..., K) @ dequantize(w).T, and rms_norm of that sum times norm_w
    rounded to int8 with the norm's scale pending (a QuantizedX with `ss`, which the int8
    kernels and `dequantize_x` apply), in the product's kernel; counts (N / 32,) int32 zeros,
    handed back zeroed. -> (new residual float32, normed QuantizedX, counts)."""
    n, k = w.shape
    lead = residual.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    x2 = x.reshape(rows) if isinstance(x, QuantizedX) else x.reshape(rows, k)
    x_out, xq, counts = int8_gemv_add_norm(x2, w, residual.reshape(rows, n), norm_w, counts,
                                           default_int8_config(w.qtype, rows, n, k), eps, out_dtype,
                                           interpret=interpret)
    return x_out.reshape(residual.shape), xq.reshape(*lead), counts


def takes_pending_norm(w, rows: int, dtype) -> bool:
    """Whether x (rows, K) @ w, where x is the residual stream RMS-normed, should be given x as
    a PendingNorm (the add and the norm applied by the product's kernel, `qmatmul_pending_norm`):
    on this backend's float decode kernel's CUDA-core tiles, for at most gemv.PENDING_NORM_MAX_M
    rows."""
    return (isinstance(w, QTensor) and jax.default_backend() == "gpu" and supports(w.qtype)
            and 0 < rows <= gemv.PENDING_NORM_MAX_M and gemv.fma_config(w, rows, dtype) is not None)


def qmatmul_pending_norm(x: PendingNorm, w: QTensor, *, partials: bool = False, implementation: str | None = None):
    """(rms_norm(x.residual + sum(x.parts)) * x.weight @ dequantize(w).T, x.residual +
    sum(x.parts)): the product (..., N) in x.dtype, or with `partials` its partial sums, and the
    new residual (..., K) float32. On the float kernel's CUDA-core tiles in one kernel where
    the backend's path (or `implementation`) has them, else materialized first."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    if implementation is None:
        implementation = "pallas" if takes_pending_norm(w, rows, x.dtype) else "reference"
    cfg = gemv.pending_norm_config(w, rows, x.dtype) if implementation != "reference" and supports(w.qtype) else None
    if cfg is None:
        residual, normed = x.materialize()
        return qmatmul(normed, w, implementation=implementation, partials=partials), residual
    out, residual = fused_qmatmul(x.reshape(rows), w, cfg, interpret=implementation == "interpret",
                                  partials=partials)
    return out.reshape(*out.shape[:-2], *lead, w.shape[0]), residual.reshape(x.shape)


def fuses_glu(w, w_down, rows: int, dtype) -> bool:
    """Whether the FFN's gate/up product x (rows, K) @ w ([gate; up] stacked) can apply the GLU
    in its own kernel (`qmatmul_glu`), either
    - rounding act(gate) * up to int8 for the down product: x comes rounded to int8
      (`takes_quantized_x`), both products run on the int8 decode GEMV, for at most
      gemv.GLU_MAX_M rows, and each half's rows fill whole tiles; or
    - storing it for a down product on the float kernel: both products on the float decode
      kernel, the gate/up one on its CUDA-core tiles, for at most gemv.FLOAT_GLU_MAX_M rows."""
    if not (isinstance(w, QTensor) and w.shape[0] % 2 == 0):
        return False
    if takes_quantized_x(w, rows, dtype):
        if not (runs_int8_gemv(w, rows, dtype) and rows <= gemv.GLU_MAX_M and w.qtype in gemv.GLU_TILES
                and runs_int8_gemv(w_down, rows, dtype)):
            return False
        half = w.shape[0] // 2
        return w.shape[0] % 64 == 0 and half % gemv.default_glu_config(w.qtype, rows, *w.shape).block_n == 0
    return (jax.default_backend() == "gpu" and supports(w.qtype) and 0 < rows <= gemv.FLOAT_GLU_MAX_M
            and int8_path(w, rows, dtype) is None and gemv.float_glu_config(w.qtype, rows, *w.shape) is not None
            and isinstance(w_down, QTensor) and supports(w_down.qtype)
            and int8_path(w_down, rows, dtype) is None and not takes_gated_x(w_down, rows, dtype))


def qmatmul_glu(x: jax.Array | QuantizedX, w: QTensor, activation: str, out_dtype, *,
                interpret: bool = False) -> jax.Array | QuantizedX:
    """act(x @ gate.T) * (x @ up.T) for w = [gate; up] (2F, K) in the product's kernel (see
    `fuses_glu`): for a QuantizedX x, rounded to int8 per 32 values -> QuantizedX (..., F);
    for a plain x, in x's dtype -> (..., F)."""
    lead = x.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    if isinstance(x, QuantizedX):
        xq = int8_gemv_glu(x.reshape(rows), w, gemv.default_glu_config(w.qtype, rows, *w.shape), activation,
                           out_dtype, interpret=interpret)
        return xq.reshape(*lead)
    cfg = gemv.float_glu_config(w.qtype, rows, *w.shape)
    if cfg is None:
        raise ValueError(f"qmatmul_glu: no float GLU tiles for {w.qtype.name} {w.shape} at {rows} rows")
    out = fused_qmatmul(x.reshape(rows, w.shape[1]), w, cfg, interpret=interpret, glu=activation)
    return out.reshape(*lead, w.shape[0] // 2)


def qmatmul(x: jax.Array | QuantizedX | GatedX, w: QTensor, *, implementation: str | None = None,
            partials: bool = False) -> jax.Array:
    """x (..., K) @ dequantize(w).T with w of logical shape (N, K) -> (..., N) in x.dtype, or
    with `partials` its S partial sums (S, ..., N) in float32."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"qmatmul: x of shape {x.shape} does not match weight {w.qtype.name} of shape {w.shape}")
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        implementation = "pallas" if on_gpu and supports(w.qtype) else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"qmatmul: implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    lead = x.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    if isinstance(x, GatedX) and (implementation == "reference" or not 0 < rows <= MAX_M or not supports(w.qtype)):
        x = x.materialize()
    if isinstance(x, GatedX):
        x2 = x.reshape(rows)
    elif isinstance(x, QuantizedX):
        x2 = x.reshape(rows)
        if implementation == "reference" or int8_path(w, rows, x.dtype) is None:
            x2 = dequantize_x(x2).astype(x.dtype)
    else:
        x2 = x.reshape(rows, k)
    if implementation != "reference" and rows and not supports(w.qtype):
        raise NotImplementedError(
            f"qmatmul: no fused kernel for {w.qtype.name}; supported: {', '.join(t.name for t in FORMATS)}")
    interpret = implementation == "interpret"
    if implementation != "reference" and 0 < rows <= MAX_M:
        out = qmatmul_gemv(x2, w, interpret=interpret, partials=partials)
        return out.reshape(*out.shape[:-2], *lead, n)
    if implementation == "reference" or rows == 0:
        out = qmatmul_reference(x2, w)
    else:
        # The interpreter always runs the fused kernel, so CPU tests cover its code.
        out = qmatmul_gemm(x2, w, path="fused" if interpret else None, interpret=interpret)
    out = out.reshape(*lead, n)
    return out[None].astype(jnp.float32) if partials else out

"""Decode GEMV on integer dot products: GGUF weights x int8-quantized activations.

The float GEMV (kernel.py) spends five or more instructions per weight value on unpacking,
int->float conversion, scaling and a multiply-add, which bounds it at a fraction of the HBM
bandwidth. This kernel does what llama.cpp's MMVQ does: the activations come rounded to
int8 (one float32 scale per 32 values, as ggml's Q8_1; pallas_kernels.int8_activations),
each 32-bit word of packed weight quants is turned into four int8 lanes with one or two logic
ops, and a `dp4a` (four int8 products summed into an int32) multiplies four values at once.
Scales and offsets are applied once per 16 or 32 values on the int32 sums, in float32.

x is either a `QuantizedX`, rounded by the kernel that produced it (the RMS norm before the
q/k/v and gate/up products, the GLU before the down product; pallas_kernels.int8_activations),
or plain activations, which every program rounds itself for the K range it covers (a 32-value
group needs nothing from outside it). The second saves the producer's extra work and, where
nothing else would have produced the rounded x, a launch; it costs per-step reductions here,
much of the kernel time for Q4_K at the 8B shapes, less than a launch at the 1B ones.
`rounds_x_itself` says which (measured, docs/kernels.md).

Weights are read as 32-bit words, four packed bytes at a time: the quant planes come either
as int32 words (`gguf_blocks.words.as_words`, the GPU layout, done once at load) or as bytes,
which the kernel assembles into words itself (measured slower: for Q4_K XLA's Triton then
spreads a chunk's words over 8 lanes and sums every dp4a with shuffles).

`int8_gemv_add_norm` is the product before an RMS norm (attention's output projection, the
FFN's down projection): it also adds its result to the residual stream and rounds
rms_norm(sum) * weight to int8 for the next products, so that no norm kernel runs between
them. A 32-value group needs nothing from outside it but the norm's scale, which needs the
whole row; that scale cancels in the rounding (it scales every value of the row alike), so it
is left pending in the QuantizedX as per-group sums of squares, and the consumer multiplies
its sums by it. The group's 32 output rows come from several programs (row tiles, K splits):
each stores its partial sums and adds one to the group's count (atomic, after a block
barrier), and the one that arrives last merges them, as the decode attention merges its
splits. The two norm kernels per layer and their gaps go, for a little more time in the
output and down products (docs/kernels.md, "The int8 GEMV").

Lowering: Pallas' Triton backend, with `dp4a` as inline PTX (`elementwise_inline_asm`):
neither Pallas-Triton nor Mosaic GPU exposes an integer dot-product primitive. In Pallas'
CPU interpreter (tests) `dp4a` is the same arithmetic written in jnp, so everything but the
one PTX instruction is tested on CPU; the GPU tests run the PTX.

Numerics: the result differs from the float product by the activation rounding (relative
error about 0.5% per value, mostly averaging out over K), as in llama.cpp. It is exact
against the float product of the dequantized weight and the dequantized int8 activations.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_activations import GatedX, QuantizedX, dequantize_x, quantize, quantize_x  # noqa: F401
from pallas_kernels.int8_activations import kernel as q8
from pallas_kernels.int8_activations import mgpu as q8_mgpu
from pallas_kernels.quant_matmul.int8_formats import F32, FORMATS, I32, as_f32, format_of, gated
from pallas_kernels.quant_matmul.tiles import index, split_k_launch
from gguf_blocks.qtensor import QTensor
from gguf_blocks.words import as_words  # noqa: F401 (re-exported)



@dataclasses.dataclass(frozen=True)
class Int8GemvConfig:
    block_n: int = 16       # weight rows per program
    block_k: int = 8        # GGUF blocks per step (power of two)
    split_k: int = 1        # programs sharing one row tile along K
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True   # load step i + 1 before the arithmetic of step i


def _iota(n):
    return jax.lax.broadcasted_iota(I32, (n,), 0)


def _load_row_ss(ss_ref, m_rows: int, k: int):
    """The per-group sums of squares (M, K/32) of x rows with a pending norm, one tile per row."""
    g = k // 32
    gp = pl.next_power_of_2(g)
    return [plgpu.load(ss_ref.at[index(m), pl.ds(0, gp)], mask=_iota(gp) < g, other=0) for m in range(m_rows)]


def _group_lane(ref, idx, g, lane, volatile=False):
    """Lane `lane` of the 32-value group g of a row ref[idx] viewed as (..., N / 4 words, 4 lanes),
    as (1, 2, 4): values 32g + 4j + lane, j = 4 * half + word (the QuantizedX word order)."""
    return plgpu.load(ref.at[tuple(idx) + (pl.ds(g * 8, 8), index(lane))], volatile=volatile).reshape(1, 2, 4)


def _add_norm_inputs(res_ref, nw_ref, g, m_rows: int):
    """The residual rows' and the norm weight's lanes of group g (loaded before the product's
    loop, so that their latency hides behind it)."""
    return ([[_group_lane(res_ref, (index(m),), g, i) for i in range(4)] for m in range(m_rows)],
            [as_f32(_group_lane(nw_ref, (), g, i)) for i in range(4)])


def _add_norm_epilogue(o_ref, inputs, out_refs, *, g, m_rows: int, split_k: int, arrivals: int, ip: bool):
    """After a program stored its partial sums: the last of the `arrivals` programs that cover
    the 32 output rows of group g adds the residual to their sum, writes the new residual and
    the group's sum of squares, and rounds residual * norm weight to int8 (see add_norm)."""
    residual, w = inputs
    xo_ref, q_refs, sso_ref, cnt_ref = out_refs[0], out_refs[1:5], out_refs[5], out_refs[6]
    if not ip:
        plgpu.debug_barrier()  # the program's partial stores before its increment (release)
    arrived = plgpu.atomic_add(cnt_ref, (g,), jnp.int32(1))

    @pl.when(arrived == arrivals - 1)
    def _merge():
        n_groups = cnt_ref.shape[0]
        for m in range(m_rows):
            h = residual[m]
            for s in range(split_k):  # past L1, which the other programs' stores did not update
                h = [a + _group_lane(o_ref, (index(s), index(m)), g, i, volatile=True) for i, a in enumerate(h)]
            for i, v in enumerate(h):
                plgpu.store(xo_ref.at[index(m), pl.ds(g * 8, 8), index(i)], v.reshape(8))
            ss = sum(jnp.sum(v * v) for v in h)
            plgpu.store(sso_ref.at[index(m), pl.ds(g, 1)], jnp.full((1,), ss, F32))
            q8.store_quantized([v * wi for v, wi in zip(h, w)], q_refs, index(m), 1, n_groups, ip, g)
        plgpu.store(cnt_ref.at[pl.ds(g, 1)], jnp.zeros((1,), I32))  # all arrived: free for the next call


def _kernel(*refs, fmt, cfg, split_out, m_rows, n_rows, n_blocks, blocks_per_split, n_x, n_w, interpret,
            activation=None, x_norm=None, add_norm=False):
    n_extra = 3 if add_norm else 0  # residual, norm weight, counts (aliased to the last output)
    n_in = n_x + (x_norm is not None) + n_w + n_extra
    x_refs, w_refs, o_ref = refs[:n_x], refs[n_in - n_w - n_extra:n_in - n_extra], refs[n_in]
    bn, bkb = cfg.block_n, cfg.block_k
    pid_n, pid_s = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * bn
    kb0 = pid_s * blocks_per_split
    kb_end = jnp.minimum(kb0 + blocks_per_split, n_blocks)
    rows = pl.ds(n0, bn)
    rmask = (n0 + _iota(bn)) < n_rows
    ms = list(range(m_rows))
    # x with a norm still to apply: its rows' sums of squares are loaded before the loop, so
    # that the load hides behind the weight stream, and reduced to one scale per row after it
    # (a reduction before the loop, with its block barrier, delayed the first weight loads).
    row_ss = _load_row_ss(refs[n_x], m_rows, x_norm[0]) if x_norm is not None else None
    norm_inputs = _add_norm_inputs(refs[n_in - 3], refs[n_in - 2], n0 // 32, m_rows) if add_norm else None

    def load(i):
        b0 = kb0 + i * bkb
        blocks = pl.ds(b0, bkb)
        bmask = (b0 + _iota(bkb)) < kb_end     # past the split's end (the prefetch after the
        wmask = rmask[:, None] & bmask[None, :]  # last step): masked, nothing is read
        if n_x == 3:
            xs = [fmt.load_xq(x_refs, m, blocks, bmask) for m in ms]
        elif activation is None:
            xs = [fmt.load_x(x_refs[0], m, blocks, bmask) for m in ms]
        else:  # a GatedX: row 2m of the view is row m's gate, row 2m + 1 its up
            xs = [gated(fmt.load_x(x_refs[0], 2 * m, blocks, bmask), fmt.load_x(x_refs[0], 2 * m + 1, blocks, bmask),
                         activation) for m in ms]
        return fmt.load_w(w_refs, rows, blocks, wmask), xs

    def products(tile):
        w, xs = tile
        return fmt.dot(w, xs, interpret)

    def step(i, carry):
        accs, tile = carry
        if not cfg.prefetch:
            return tuple(a + p for a, p in zip(accs, products(load(i)))), tile
        following = load(i + 1)
        return tuple(a + p for a, p in zip(accs, products(tile))), following

    zeros = tuple(jnp.zeros((bn, bkb) + fmt.acc_tail, F32) for _ in ms)
    accs, _ = jax.lax.fori_loop(0, blocks_per_split // bkb, step,
                                (zeros, load(0) if cfg.prefetch else ()))
    outs = []
    for m, acc in enumerate(accs):
        while acc.ndim > 2:
            acc = jnp.sum(acc, axis=-1)
        out = jnp.sum(acc, axis=1)
        if row_ss is not None:
            k_all, eps = x_norm
            out = out * jax.lax.rsqrt(jnp.sum(row_ss[m]) / k_all + eps)
        outs.append(out)
    for m, out in enumerate(outs):
        if add_norm:  # the partials in the (S, M, N / 4, 4) view the epilogue reads lanes of
            plgpu.store(o_ref.at[pid_s, index(m), pl.ds(n0 // 4, bn // 4), :], out.reshape(bn // 4, 4))
            continue
        idx = (pid_s, index(m), rows) if split_out else (index(m), rows)
        plgpu.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=rmask)
    if add_norm:
        _add_norm_epilogue(o_ref, norm_inputs, refs[n_in + 1:], g=n0 // 32, m_rows=m_rows, split_k=cfg.split_k,
                           arrivals=(32 // bn) * cfg.split_k, ip=interpret)


# Rows per call (the kernel unrolls them): up to 16, so that its tiles can be measured there
# against the float kernel; the dispatch uses it up to gemv.INT8_MAX_M rows per type.
MAX_M = 16
# Raw x is rounded in the kernel for at most this many rows (measured at M=1): every program
# rounds every row for its K range, so that work grows with M while the weight tile does not.
ROUNDS_IN_KERNEL_MAX_M = 2


def supports(qtype: QType) -> bool:
    return qtype in FORMATS


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "partials"))
def int8_gemv(x: jax.Array | QuantizedX | GatedX, w: QTensor, cfg: Int8GemvConfig = Int8GemvConfig(),
              interpret: bool = False, partials: bool = False) -> jax.Array:
    """x (M <= MAX_M, K) @ dequantize(w).T -> (M, N) on int8 dot products, in x's dtype (a
    QuantizedX's `dtype`); with `partials`, the split-K partial sums (split_k, M, N) in
    float32, for the consumer to add. A GatedX's GLU is applied where x is rounded: in the
    kernel's programs, or in the rounding pass before it. A QuantizedX with a pending norm
    (`ss`) has its rows' scales applied to the sums."""
    (out,), _ = _launch(x, w, cfg, interpret, partials)
    if cfg.split_k > 1 and not partials:
        out = out.sum(axis=0).astype(x.dtype)
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "eps", "out_dtype", "interpret"), donate_argnames=("counts",))
def int8_gemv_add_norm(x: jax.Array | QuantizedX, w: QTensor, residual: jax.Array, norm_w: jax.Array,
                       counts: jax.Array, cfg: Int8GemvConfig, eps: float, out_dtype=jnp.bfloat16,
                       interpret: bool = False):
    """The product x @ dequantize(w).T added to the residual stream and RMS-normed for the next
    product, in the product's own kernel -> (residual + product (M, N) float32, QuantizedX of
    rms_norm(that) * norm_w with the norm pending (`quantize_normed`), counts).

    The 32 output rows of a group are summed by several programs (row tiles and K splits); each
    adds one to the group's count after storing its partial sums, and the last to arrive merges
    the group. Nothing outside the group is needed: the norm's scale, which needs the whole
    row, is left to the consumer (one factor per row on its sums). counts: (N / 32,) int32
    zeros, handed back zeroed (donated: a caller can pass them on from call to call)."""
    m_rows, (n_rows, _) = x.shape[0], w.shape
    if n_rows % 32 or 32 % cfg.block_n:
        raise ValueError(f"int8_gemv_add_norm: weight {w.qtype.name} {w.shape}: N must be a multiple of 32 "
                         f"and block_n ({cfg.block_n}) must divide 32")
    if residual.shape != (m_rows, n_rows) or norm_w.shape != (n_rows,) or counts.shape != (n_rows // 32,):
        raise ValueError(f"int8_gemv_add_norm: residual {residual.shape}, norm weight {norm_w.shape} and counts "
                         f"{counts.shape} do not match the product ({m_rows}, {n_rows})")
    (_, x_out, words, d, dsum32, dsum16, ss, counts), _ = _launch(
        x, w, cfg, interpret, True, add_norm=(residual.astype(F32), norm_w.astype(F32), counts))
    xq = q8.as_quantized((words, d, dsum32, dsum16), m_rows, n_rows, out_dtype)
    return x_out.reshape(m_rows, n_rows), dataclasses.replace(xq, ss=ss, eps=float(eps)), counts


def _launch(x, w: QTensor, cfg: Int8GemvConfig, interpret: bool, partials: bool, add_norm=None):
    """The pallas_call behind int8_gemv and int8_gemv_add_norm: (outputs, x as multiplied)."""
    if w.qtype not in FORMATS:
        raise NotImplementedError(f"int8_gemv: no kernel for {w.qtype.name}")
    fmt = format_of(w)
    n_rows, k = w.shape
    m_rows = x.shape[0]
    if len(x.shape) != 2 or x.shape[1] != k or not 1 <= m_rows <= MAX_M:
        raise ValueError(f"int8_gemv: x of shape {x.shape} for weight {w.qtype.name} {w.shape} "
                         f"(M must be 1..{MAX_M})")
    n_blocks = k // fmt.block_size
    out_dtype = x.dtype
    if not isinstance(x, QuantizedX) and (w.qtype == QType.Q6_K or m_rows > ROUNDS_IN_KERNEL_MAX_M):
        # Rounded first, in one small kernel: per program, Q6_K's 16-value groups made the
        # kernel several times slower, and many rows multiply the rounding work.
        impl = ("interpret" if interpret else "pallas") if q8_mgpu.supports(k) else "reference"
        x = (quantize(x.gate_up, x.activation, implementation=impl) if isinstance(x, GatedX)
             else quantize(x, implementation=impl))
    activation = x.activation if isinstance(x, GatedX) else None
    x_norm = None
    if isinstance(x, QuantizedX):
        x_views = fmt.xq_views(x, m_rows, n_blocks)
        if x.ss is not None:
            x_views, x_norm = (*x_views, x.ss.reshape(m_rows, k // 32)), (k, x.eps)
    elif activation is not None:
        x_views = (fmt.x_view(x.gate_up.reshape(2 * m_rows, k), 2 * m_rows, n_blocks),)
    else:
        x_views = (fmt.x_view(x, m_rows, n_blocks),)
    w_views = fmt.w_views(w.planes, n_rows, n_blocks)
    blocks_per_split, out_shape = split_k_launch(n_blocks, cfg.block_k, cfg.split_k, m_rows, n_rows, out_dtype,
                                                 partials)
    out_shapes, extra, aliases = [out_shape], [], {}
    if add_norm is not None:
        residual, norm_w, counts = add_norm
        # Rows in (N / 4 words, 4 lanes) views, whose lanes the epilogue loads without strides.
        out_shapes = [jax.ShapeDtypeStruct((cfg.split_k, m_rows, n_rows // 4, 4), F32),
                      jax.ShapeDtypeStruct((m_rows, n_rows // 4, 4), F32), *q8.quantized_out_shapes(m_rows, n_rows),
                      jax.ShapeDtypeStruct((m_rows, n_rows // 32), F32), jax.ShapeDtypeStruct(counts.shape, I32)]
        extra = [residual.reshape(m_rows, n_rows // 4, 4), norm_w.reshape(n_rows // 4, 4), counts]
        aliases = {len(x_views) + len(w_views) + 2: len(out_shapes) - 1}
    grid = (pl.cdiv(n_rows, cfg.block_n), cfg.split_k)
    kernel = functools.partial(_kernel, fmt=fmt, cfg=cfg, split_out=len(out_shape.shape) == 3, m_rows=m_rows,
                               n_rows=n_rows, n_blocks=n_blocks, blocks_per_split=blocks_per_split,
                               n_x=len(x_views) - (x_norm is not None), n_w=len(w_views), interpret=interpret,
                               activation=activation, x_norm=x_norm, add_norm=add_norm is not None)
    wbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in w_views)
    xbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in x_views)
    outs = pl.pallas_call(
        kernel, out_shape=out_shapes, grid=grid, input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=pl.CostEstimate(flops=2 * m_rows * w.shape[0] * k, transcendentals=0,
                                      bytes_accessed=wbytes + xbytes + m_rows * n_rows * 4),
        interpret=interpret, name=f"int8_gemv_{w.qtype.name.lower()}" + ("_add_norm" if add_norm is not None else ""),
    )(*x_views, *w_views, *extra)
    return outs, x

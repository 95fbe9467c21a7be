"""The fused quantized matmul: one Pallas kernel that streams GGUF planes, dequantizes each
tile on chip and multiplies it with x. `gemv.py` (decode) and `gemm.py` (prefill) pick its
tile sizes; the kernel itself is shared.

Lowering: Pallas' Triton backend. JAX 0.11 deprecates it in favour of Mosaic GPU, but the
kernel needs byte/nibble unpacking with shifts and masks on uint8 tiles, register
reshapes of those tiles into MMA operands, and masked loads at arbitrary row/block edges;
Triton expresses all of it and runs in Pallas' interpreter on CPU (so the exact kernel code
is tested without a GPU), while Mosaic GPU's layouts for sub-word integer tiles and its
interpreter with blocked specs did not work for this. Measured numbers live in
docs/kernels.md.

Program (n, m, s) of the grid owns output rows x[m*BM : (m+1)*BM] and weight rows
w[n*BN : (n+1)*BN] and the s-th of `split_k` equal ranges of blocks along K. It walks its
range `block_k` blocks at a time; each step loads the blocks' planes once, turns every run
of the block (see tiles.py) into a (BN, block_k * run) tile and either
  - "mma": casts the tile to x's dtype (bf16/f16; f32 stays f32 and uses an exact f32 dot)
    and accumulates tile @ x_run.T on the tensor cores, in float32 (with dequant="bf16x2" the
    format makes the bf16 tiles itself, with packed PTX: tiles.py); or
  - "fma": for M <= 8, multiplies on the CUDA cores in float32, accumulating elementwise
    into a tile-sized accumulator that is reduced once after the K loop.
Every weight byte is read from HBM once per program column, so with one M tile (decode) the
weight is read exactly once. Rows, blocks and x rows past the edges are masked to zero;
N, M and the number of blocks need not divide the tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_activations import GatedX
from pallas_kernels.int8_activations.reference import activate
from pallas_kernels.quant_matmul.tiles import FORMATS, format_of, index, split_k_launch
from pallas_kernels.rms_norm.pending import PendingNorm
from gguf_blocks.qtensor import QTensor


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int          # x rows per program (power of two; >= 16 for "mma")
    block_n: int          # weight rows per program (power of two; >= 16 for "mma")
    block_k: int          # GGUF blocks per K step (power of two)
    split_k: int = 1      # programs sharing one output tile along K (partial sums added after)
    method: str = "mma"   # "mma" (tensor cores) or "fma" (CUDA cores, M <= 8)
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "f32"  # "f32", or "bf16x2" (packed bf16 instructions, "mma" with bf16 x; tiles.py)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"TileConfig.{name}={v} must be a power of two")
        if self.method not in ("mma", "fma"):
            raise ValueError(f"TileConfig.method={self.method!r}: expected 'mma' or 'fma'")
        if self.method == "mma" and min(self.block_m, self.block_n) < 16:
            raise ValueError(f"TileConfig: 'mma' needs block_m, block_n >= 16, got {self}")
        if self.dequant not in ("f32", "bf16x2") or (self.dequant == "bf16x2" and self.method != "mma"):
            raise ValueError(f"TileConfig.dequant={self.dequant!r}: expected 'f32', or 'bf16x2' with 'mma'")


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _kernel(x_ref, *refs, fmt, cfg: TileConfig, split_out, m_rows, n_rows, n_blocks, blocks_per_split, cdt,
            activation, norm, interpret):
    """activation: None, x_ref is x by block; else x_ref is [gate | up] by half and block, and x
    is act(gate) * up, evaluated in float32 as each tile is loaded (a GatedX).
    norm: None, or (S, eps) for a PendingNorm: x_ref is the residual by block, followed in refs
    by its S partial sums (if S) and the norm weight; x is residual + sum(parts) times the
    weight, and the sums are scaled by each row's 1/rms (from the whole row, loaded once).
    The programs of the first weight-row tile store residual + sum(parts) to the last output
    ("fma" only)."""
    n_parts = 0 if norm is None else norm[0]
    n_norm_in = 0 if norm is None else n_parts and 1
    parts_ref = refs[0] if n_parts else None
    norm_w_ref = refs[n_norm_in] if norm is not None else None
    refs = refs[n_norm_in + 1:] if norm is not None else refs
    *w_refs, o_ref = refs if norm is None else refs[:-1]
    res_out_ref = refs[-1] if norm is not None else None
    pid_n, pid_m, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def row_tiles(rows, blocks, seg, mask):
        """The residual's and the parts' tiles, loaded; summed where they are used."""
        tiles = [plgpu.load(x_ref.at[rows, blocks, seg], mask=mask, other=0)]
        for s in range(n_parts):
            tiles.append(plgpu.load(parts_ref.at[jnp.int32(s), rows, blocks, seg], mask=mask, other=0))
        return tiles

    def normed_x(rows, blocks, seg, mask):
        """(residual + sum(parts)) * norm weight, and residual + sum(parts), stored as the new
        residual by the first weight-row tile's programs."""
        h = functools.reduce(jnp.add, [t.astype(jnp.float32) for t in row_tiles(rows, blocks, seg, mask)])
        plgpu.store(res_out_ref.at[rows, blocks, seg], h, mask=mask & (pid_n == 0))
        return h * plgpu.load(norm_w_ref.at[blocks, seg], mask=mask, other=0).astype(jnp.float32), h

    def load_x(rows, blocks, seg, mask):
        if activation is None:
            return plgpu.load(x_ref.at[rows, blocks, seg, :, :], mask=mask, other=0)
        gate = plgpu.load(x_ref.at[rows, jnp.int32(0), blocks, seg, :, :], mask=mask, other=0)
        up = plgpu.load(x_ref.at[rows, jnp.int32(1), blocks, seg, :, :], mask=mask, other=0)
        return activate(gate, activation) * up.astype(jnp.float32)

    bm, bn, bkb = cfg.block_m, cfg.block_n, cfg.block_k
    n0, m0 = pid_n * bn, pid_m * bm
    kb0 = pid_s * blocks_per_split
    kb_end = jnp.minimum(kb0 + blocks_per_split, n_blocks)
    rows, xrows = pl.ds(n0, bn), pl.ds(m0, bm)
    rmask = (n0 + _iota(bn)) < n_rows
    xmask = (m0 + _iota(bm)) < m_rows
    run, sub = fmt.seg_len, fmt.sub
    # f32 operands: an exact f32 dot (Triton's default for f32 would be tf32).
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None

    def step_mma(i, acc):
        b0 = kb0 + i * bkb
        blocks = pl.ds(b0, bkb)
        bmask = (b0 + _iota(bkb)) < kb_end
        wmask = rmask[:, None] & bmask[None, :]
        xm = (xmask[:, None] & bmask[None, :]).reshape(bm, bkb, 1, 1)
        for part in fmt.parts(w_refs, rows, blocks, wmask):
            w = part.q * part.scale[..., None]
            if part.bias is not None:
                w = w + part.bias[..., None]
            w = w.reshape(bn, bkb * run).astype(cdt)
            xp = load_x(xrows, blocks, index(part.seg), xm).reshape(bm, bkb * run).astype(cdt)
            acc = acc + jax.lax.dot_general(w, xp, (((1,), (1,)), ((), ())), precision=precision,
                                            preferred_element_type=jnp.float32)
        return acc

    def step_tile(i, acc):
        # The format dequantizes whole blocks to bf16, one tile per x half-segment (see tiles.py).
        b0 = kb0 + i * bkb
        blocks = pl.ds(b0, bkb)
        bmask = (b0 + _iota(bkb)) < kb_end
        xm = (xmask[:, None] & bmask[None, :]).reshape(bm, bkb, 1, 1)
        for h, w in enumerate(fmt.tile(w_refs, rows, blocks, rmask[:, None] & bmask[None, :], interpret)):
            xp = plgpu.load(x_ref.at[xrows, blocks, :, index(h), :], mask=xm, other=0)
            acc = acc + jax.lax.dot_general(w.reshape(bn, -1), xp.reshape(bm, -1), (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        return acc

    # A PendingNorm's 1/rms needs the sum of squares of the whole row: a program whose range
    # covers all of K sums it from the tiles it loads anyway; one with part of K loads the
    # whole row before its loop and sums it after, so that the loads overlap the weights'.
    whole_row = blocks_per_split >= n_blocks

    def step_fma(i, carry):
        # Elementwise accumulation into a full (BN, BKB, sub, run/sub) tile per x row: no
        # reductions or layout changes inside the loop; one reduction after it.
        accs, squares = map(list, carry)
        b0 = kb0 + i * bkb
        blocks = pl.ds(b0, bkb)
        bmask = (b0 + _iota(bkb)) < kb_end
        wmask = rmask[:, None] & bmask[None, :]
        for part in fmt.parts(w_refs, rows, blocks, wmask):
            w = part.q * part.scale[..., None]
            if part.bias is not None:
                w = w + part.bias[..., None]
            for m in range(bm):
                xmask_m = (bmask & (m0 + m < m_rows)).reshape(bkb, 1, 1)
                if norm is None:
                    xp = load_x(m0 + m, blocks, index(part.seg), xmask_m).astype(jnp.float32)
                else:
                    xp, h = normed_x(m0 + m, blocks, index(part.seg), xmask_m)
                    if whole_row:
                        squares[m] = squares[m] + h * h
                accs[m] = accs[m] + w * xp[None]
        return tuple(accs), tuple(squares)

    n_steps = blocks_per_split // bkb
    if cfg.method == "mma":
        acc = jax.lax.fori_loop(0, n_steps, step_tile if fmt.tile else step_mma, jnp.zeros((bn, bm), jnp.float32))
        out = acc.T.astype(o_ref.dtype)
        idx = (pid_s, xrows, rows) if split_out else (xrows, rows)
        plgpu.store(o_ref.at[idx], out, mask=xmask[:, None] & rmask[None, :])
    else:
        tile = (bn, bkb, sub, run // sub)
        every = pl.next_power_of_2(n_blocks)
        rows_ahead = []
        if norm is not None and not whole_row:
            rows_ahead = [row_tiles(m0 + m, pl.ds(0, every), slice(None),
                                    ((_iota(every) < n_blocks) & (m0 + m < m_rows)).reshape(every, 1, 1, 1))
                          for m in range(bm)]
        squares = tuple(jnp.zeros(tile[1:], jnp.float32) for _ in range(bm if norm is not None and whole_row else 0))
        accs, squares = jax.lax.fori_loop(
            0, n_steps, step_fma, (tuple(jnp.zeros(tile, jnp.float32) for _ in range(bm)), squares))
        sums = [jnp.sum(jnp.sum(jnp.sum(acc, axis=3), axis=2), axis=1) for acc in accs]
        if norm is not None:
            if whole_row:
                ss = [jnp.sum(sq) for sq in squares]
            else:
                hs = [functools.reduce(jnp.add, [t.astype(jnp.float32) for t in ts]) for ts in rows_ahead]
                ss = [jnp.sum(h * h) for h in hs]
            k = n_blocks * fmt.block_size
            sums = [sums[m] * jax.lax.rsqrt(ss[m] / k + norm[1]) for m in range(bm)]
        for m in range(bm):
            idx = (pid_s, m0 + m, rows) if split_out else (m0 + m, rows)
            plgpu.store(o_ref.at[idx], sums[m].astype(o_ref.dtype), mask=rmask & (m0 + m < m_rows))


def compute_dtype(dtype) -> jnp.dtype:
    """MMA operand dtype for activations of `dtype`: bf16/f16 as given, anything else f32."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "partials"))
def fused_qmatmul(x: jax.Array | GatedX | PendingNorm, w: QTensor, cfg: TileConfig, interpret: bool = False,
                  partials: bool = False):
    """x (M, K) @ dequantize(w).T -> (M, N) in x.dtype, by the fused kernel with tiles `cfg`;
    with `partials`, the split-K partial sums (split_k, M, N) in float32. x may be a GatedX,
    whose GLU the kernel applies as it loads x. x may be a PendingNorm ("fma" tiles), whose
    add and norm the kernel applies: the result is then (product, residual + sum(parts) (M, K))."""
    if w.qtype not in FORMATS:
        raise NotImplementedError(f"fused_qmatmul: no kernel for {w.qtype.name}; have "
                                  f"{', '.join(t.name for t in FORMATS)}")
    fmt = format_of(w, cfg.dequant)
    if cfg.dequant != "f32" and (isinstance(x, (GatedX, PendingNorm)) or x.dtype != jnp.bfloat16):
        raise ValueError(f"fused_qmatmul: {cfg.dequant} dequantization takes plain bf16 x, got "
                         f"{type(x).__name__} {x.dtype}")
    pending = isinstance(x, PendingNorm)
    if pending and cfg.method != "fma":
        raise ValueError(f"fused_qmatmul: a PendingNorm x is normed by 'fma' tiles, got {cfg}")
    n_rows, k = w.shape
    m_rows = x.shape[0]
    if len(x.shape) != 2 or x.shape[1] != k:
        raise ValueError(f"fused_qmatmul: x of shape {x.shape} does not match weight {w.qtype.name} {w.shape}")
    if k % fmt.block_size:
        raise ValueError(f"fused_qmatmul: K={k} is not a multiple of the {w.qtype.name} block size {fmt.block_size}")
    if cfg.method == "fma" and cfg.block_m > 8:
        raise ValueError(f"fused_qmatmul: 'fma' unrolls over x rows; block_m={cfg.block_m} > 8")
    n_blocks = k // fmt.block_size
    blocks_per_split, out_shape = split_k_launch(n_blocks, cfg.block_k, cfg.split_k, m_rows, n_rows, x.dtype,
                                                 partials)
    by_block = (n_blocks, fmt.segments, fmt.sub, fmt.seg_len // fmt.sub)
    activation = x.activation if isinstance(x, GatedX) else None
    norm_in, norm = [], None
    if pending:
        if x.residual.dtype != jnp.float32 or x.weight.shape != (k,) or (
                x.parts is not None and x.parts.shape[1:] != x.residual.shape):
            raise ValueError(f"fused_qmatmul: a PendingNorm of a float32 residual {x.residual.shape} "
                             f"{x.residual.dtype}, parts {None if x.parts is None else x.parts.shape} and "
                             f"weight {x.weight.shape} for K={k}")
        x5 = x.residual.reshape(m_rows, *by_block)
        if x.parts is not None:
            norm_in.append(x.parts.astype(jnp.float32).reshape(x.parts.shape[0], m_rows, *by_block))
        norm_in.append(x.weight.reshape(by_block))
        norm = (0 if x.parts is None else x.parts.shape[0], float(x.eps))
        out_shape = (out_shape, jax.ShapeDtypeStruct(x5.shape, jnp.float32))
    elif activation is None:
        x5 = x.reshape(m_rows, *by_block)
    else:
        x5 = x.gate_up.reshape(m_rows, 2, *by_block)
    views = fmt.views(w.planes)
    grid = (pl.cdiv(n_rows, cfg.block_n), pl.cdiv(m_rows, cfg.block_m), cfg.split_k)
    product_shape = out_shape[0] if pending else out_shape
    kernel = functools.partial(
        _kernel, fmt=fmt, cfg=cfg, split_out=len(product_shape.shape) == 3, m_rows=m_rows, n_rows=n_rows,
        n_blocks=n_blocks, blocks_per_split=blocks_per_split, cdt=compute_dtype(x.dtype), activation=activation,
        norm=norm, interpret=interpret)
    wbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in views)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=pl.CostEstimate(
            flops=2 * m_rows * w.shape[0] * k, transcendentals=0,
            bytes_accessed=wbytes * grid[1] + x5.size * x5.dtype.itemsize * grid[0]
            + m_rows * n_rows * jnp.dtype(product_shape.dtype).itemsize * cfg.split_k),
        interpret=interpret,
        name=f"qmatmul_{w.qtype.name.lower()}" + ("_norm" if pending else ""),
    )(x5, *norm_in, *views)
    residual = None
    if pending:
        out, residual = out[0], out[1].reshape(m_rows, k)
    if cfg.split_k > 1 and not partials:
        out = out.sum(axis=0).astype(x.dtype)
    return out if residual is None else (out, residual)

"""The fused quantized matmul: one Pallas kernel that streams GGUF planes, dequantizes each
tile on chip and multiplies it with x. `gemv.py` (decode) and `gemm.py` (prefill) pick its
tile sizes; the kernel itself is shared.

Lowering: Pallas' Triton backend. JAX 0.11 deprecates it in favour of Mosaic GPU, but the
kernel needs byte/nibble unpacking with shifts and masks on uint8 tiles, register
reshapes of those tiles into MMA operands, and masked loads at arbitrary row/block edges;
Triton expresses all of it and runs in Pallas' interpreter on CPU (so the exact kernel code
is tested without a GPU), while Mosaic GPU's layouts for sub-word integer tiles and its
interpreter with blocked specs did not work for this. Measured numbers live in
benchmarks/NOTES-quant_matmul.md.

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
from rjax.quant.qtensor import QTensor


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
            activation, glu, interpret):
    """activation: None, x_ref is x by block; else x_ref is [gate | up] by half and block, and x
    is act(gate) * up, evaluated in float32 as each tile is loaded (a GatedX).
    glu: None, or the weight is [gate; up] (2 n_rows, K) and the program multiplies its gate rows
    and the up rows n_rows further on, and stores act(gate) * up ("fma" only, one split)."""
    *w_refs, o_ref = refs

    def load_x(rows, blocks, seg, mask):
        if activation is None:
            return plgpu.load(x_ref.at[rows, blocks, seg, :, :], mask=mask, other=0)
        gate = plgpu.load(x_ref.at[rows, jnp.int32(0), blocks, seg, :, :], mask=mask, other=0)
        up = plgpu.load(x_ref.at[rows, jnp.int32(1), blocks, seg, :, :], mask=mask, other=0)
        return activate(gate, activation) * up.astype(jnp.float32)

    bm, bn, bkb = cfg.block_m, cfg.block_n, cfg.block_k
    pid_n, pid_m, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n0, m0 = pid_n * bn, pid_m * bm
    kb0 = pid_s * blocks_per_split
    kb_end = jnp.minimum(kb0 + blocks_per_split, n_blocks)
    rows, xrows = pl.ds(n0, bn), pl.ds(m0, bm)
    row_sets = (rows,) if glu is None else (rows, pl.ds(n0 + n_rows, bn))  # gate rows, then their up rows
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

    def step_fma(i, accs):
        # Elementwise accumulation into a full (BN, BKB, sub, run/sub) tile per x row: no
        # reductions or layout changes inside the loop; one reduction after it.
        b0 = kb0 + i * bkb
        blocks = pl.ds(b0, bkb)
        bmask = (b0 + _iota(bkb)) < kb_end
        wmask = rmask[:, None] & bmask[None, :]
        accs = list(accs)
        for r, row_set in enumerate(row_sets):
            for part in fmt.parts(w_refs, row_set, blocks, wmask):
                w = part.q * part.scale[..., None]
                if part.bias is not None:
                    w = w + part.bias[..., None]
                for m in range(bm):
                    xmask_m = bmask & (m0 + m < m_rows)
                    xp = load_x(m0 + m, blocks, index(part.seg), xmask_m.reshape(bkb, 1, 1)).astype(jnp.float32)
                    accs[r * bm + m] = accs[r * bm + m] + w * xp[None]
        return tuple(accs)

    n_steps = blocks_per_split // bkb
    if cfg.method == "mma":
        acc = jax.lax.fori_loop(0, n_steps, step_tile if fmt.tile else step_mma, jnp.zeros((bn, bm), jnp.float32))
        out = acc.T.astype(o_ref.dtype)
        idx = (pid_s, xrows, rows) if split_out else (xrows, rows)
        plgpu.store(o_ref.at[idx], out, mask=xmask[:, None] & rmask[None, :])
    else:
        tile = (bn, bkb, sub, run // sub)
        accs = jax.lax.fori_loop(0, n_steps, step_fma,
                                 tuple(jnp.zeros(tile, jnp.float32) for _ in range(bm * len(row_sets))))
        sums = [jnp.sum(jnp.sum(jnp.sum(acc, axis=3), axis=2), axis=1) for acc in accs]
        for m in range(bm):
            out = sums[m] if glu is None else activate(sums[m], glu) * sums[bm + m]
            idx = (pid_s, m0 + m, rows) if split_out else (m0 + m, rows)
            plgpu.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=rmask & (m0 + m < m_rows))


def compute_dtype(dtype) -> jnp.dtype:
    """MMA operand dtype for activations of `dtype`: bf16/f16 as given, anything else f32."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "partials", "glu"))
def fused_qmatmul(x: jax.Array | GatedX, w: QTensor, cfg: TileConfig, interpret: bool = False,
                  partials: bool = False, glu: str | None = None) -> jax.Array:
    """x (M, K) @ dequantize(w).T -> (M, N) in x.dtype, by the fused kernel with tiles `cfg`;
    with `partials`, the split-K partial sums (split_k, M, N) in float32. x may be a GatedX,
    whose GLU the kernel applies as it loads x. With `glu` (an activation), w is [gate; up]
    (2F, K) and the result act(x @ gate.T) * (x @ up.T) (M, F), applied as the kernel stores
    its rows ("fma" tiles with one split)."""
    if w.qtype not in FORMATS:
        raise NotImplementedError(f"fused_qmatmul: no kernel for {w.qtype.name}; have "
                                  f"{', '.join(t.name for t in FORMATS)}")
    fmt = format_of(w, cfg.dequant)
    if cfg.dequant != "f32" and (isinstance(x, GatedX) or x.dtype != jnp.bfloat16):
        raise ValueError(f"fused_qmatmul: {cfg.dequant} dequantization takes plain bf16 x, got "
                         f"{type(x).__name__} {x.dtype}")
    n_rows, k = w.shape
    if glu is not None:
        if cfg.method != "fma" or cfg.split_k != 1 or partials or isinstance(x, GatedX):
            raise ValueError(f"fused_qmatmul: the GLU is applied by 'fma' tiles with split_k 1 to a plain x, got "
                             f"{cfg}, partials={partials}, x {type(x).__name__}")
        if n_rows % 2:
            raise ValueError(f"fused_qmatmul: a [gate; up] weight has an even row count, got {w.shape}")
        activate(jnp.zeros((), jnp.float32), glu)  # names an unknown activation here, not in the kernel
        n_rows //= 2
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
    x5 = x.reshape(m_rows, *by_block) if activation is None else x.gate_up.reshape(m_rows, 2, *by_block)
    views = fmt.views(w.planes)
    grid = (pl.cdiv(n_rows, cfg.block_n), pl.cdiv(m_rows, cfg.block_m), cfg.split_k)
    kernel = functools.partial(
        _kernel, fmt=fmt, cfg=cfg, split_out=len(out_shape.shape) == 3, m_rows=m_rows, n_rows=n_rows, n_blocks=n_blocks,
        blocks_per_split=blocks_per_split, cdt=compute_dtype(x.dtype), activation=activation, glu=glu,
        interpret=interpret)
    wbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in views)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=pl.CostEstimate(
            flops=2 * m_rows * w.shape[0] * k, transcendentals=0,
            bytes_accessed=wbytes * grid[1] + x5.size * x5.dtype.itemsize * grid[0]
            + m_rows * n_rows * jnp.dtype(out_shape.dtype).itemsize * cfg.split_k),
        interpret=interpret,
        name=f"qmatmul_{w.qtype.name.lower()}" + ("_glu" if glu else ""),
    )(x5, *views)
    if cfg.split_k > 1 and not partials:
        out = out.sum(axis=0).astype(x.dtype)
    return out

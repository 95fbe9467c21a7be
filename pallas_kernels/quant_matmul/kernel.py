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
N, M and the number of blocks need not divide the tiles. On "mma" tiles
`fused_qmatmul_add_norm` also adds the product to the residual stream and norms it for the next
product (the last program of each weight-row tile merges the tile's split-K partials).
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
from pallas_kernels.rms_norm.pending import NormedRows, PendingNorm
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
            activation, norm, row_scale, add_norm, interpret):
    """activation: None, x_ref is x by block; else x_ref is [gate | up] by half and block, and x
    is act(gate) * up, evaluated in float32 as each tile is loaded (a GatedX).
    norm: None, or (S, eps) for a PendingNorm: x_ref is the residual by block, followed in refs
    by its S partial sums (if S) and the norm weight; x is residual + sum(parts) times the
    weight, and the sums are scaled by each row's 1/rms (from the whole row, loaded once).
    The programs of the first weight-row tile store residual + sum(parts) to the last output
    ("fma" only).
    row_scale: None, or the eps of NormedRows x: x_ref is x, followed in refs by its sums of
    squares per 32 values; the sums are scaled by each row's 1/rms ("mma" only).
    add_norm: after the weights come the residual, the norm weight and the counts; the outputs
    are the partial sums, the new residual, the NormedRows' x and sums of squares, and the
    counts (see fused_qmatmul_add_norm; "mma" only)."""
    refs = list(refs)
    n_parts = 0 if norm is None else norm[0]
    parts_ref = refs.pop(0) if n_parts else None
    norm_w_ref = refs.pop(0) if norm is not None else None
    ss_ref = refs.pop(0) if row_scale is not None else None
    n_out = 5 if add_norm else 1 + (norm is not None)
    n_w = len(refs) - n_out - (3 if add_norm else 0)
    w_refs, extra, outs = refs[:n_w], refs[n_w:len(refs) - n_out], refs[len(refs) - n_out:]
    o_ref = outs[0]
    res_out_ref = outs[1] if norm is not None else None
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
        k_all = n_blocks * fmt.block_size
        tile_mask = xmask[:, None] & rmask[None, :]
        # Loaded before the loop, so that their latency hides behind the weights'.
        if row_scale is not None:
            groups = pl.next_power_of_2(k_all // 32)
            row_ss = plgpu.load(ss_ref.at[xrows, pl.ds(0, groups)],
                                mask=xmask[:, None] & (_iota(groups) < k_all // 32)[None, :], other=0)
        if add_norm:
            residual = plgpu.load(extra[0].at[xrows, rows], mask=tile_mask, other=0)
            norm_w = plgpu.load(extra[1].at[rows], mask=rmask, other=0).astype(jnp.float32)
        acc = jax.lax.fori_loop(0, n_steps, step_tile if fmt.tile else step_mma, jnp.zeros((bn, bm), jnp.float32))
        if row_scale is not None:
            acc = acc * jax.lax.rsqrt(jnp.sum(row_ss, axis=1) / k_all + row_scale)[None, :]
        idx = (pid_s, xrows, rows) if split_out else (xrows, rows)
        plgpu.store(o_ref.at[idx], acc.T.astype(o_ref.dtype), mask=tile_mask)
        if add_norm:
            _add_norm_epilogue(o_ref, residual, norm_w, outs[1:], pid_n=pid_n, xrows=xrows, rows=rows,
                               xmask=xmask, tile_mask=tile_mask, bm=bm, bn=bn, n_rows=n_rows,
                               split_k=cfg.split_k, interpret=interpret)
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


def _add_norm_epilogue(o_ref, residual, norm_w, out_refs, *, pid_n, xrows, rows, xmask, tile_mask, bm, bn,
                       n_rows, split_k, interpret):
    """After a program stored its partial sums: the last of the split_k programs of weight-row
    tile pid_n adds the residual to their sum, writes the new residual, the sum times the norm
    weight in the activations' dtype, and its sums of squares per 32 values (the norm's scale,
    which needs the whole row, is left to the consumer)."""
    xo_ref, xn_ref, sso_ref, cnt_ref = out_refs
    if not interpret:
        plgpu.debug_barrier()  # the program's partial stores before its increment (release)
    arrived = plgpu.atomic_add(cnt_ref, (pid_n,), jnp.int32(1))

    @pl.when(arrived == split_k - 1)
    def _merge():
        h = residual
        for s in range(split_k):  # past L1, which the other programs' stores did not update
            h = h + plgpu.load(o_ref.at[jnp.int32(s), xrows, rows], mask=tile_mask, other=0, volatile=True)
        plgpu.store(xo_ref.at[xrows, rows], h, mask=tile_mask)
        plgpu.store(xn_ref.at[xrows, rows], (h * norm_w[None, :]).astype(xn_ref.dtype), mask=tile_mask)
        groups = bn // 32
        ss = jnp.sum((h * h).reshape(bm, groups, 32), axis=2)
        g0 = pid_n * groups
        plgpu.store(sso_ref.at[xrows, pl.ds(g0, groups)], ss,
                    mask=xmask[:, None] & ((g0 + _iota(groups)) * 32 < n_rows)[None, :])
        plgpu.store(cnt_ref.at[pl.ds(pid_n, 1)], jnp.zeros((1,), jnp.int32))  # free for the next call


def compute_dtype(dtype) -> jnp.dtype:
    """MMA operand dtype for activations of `dtype`: bf16/f16 as given, anything else f32."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "partials"))
def fused_qmatmul(x: jax.Array | GatedX | PendingNorm | NormedRows, w: QTensor, cfg: TileConfig,
                  interpret: bool = False, partials: bool = False):
    """x (M, K) @ dequantize(w).T -> (M, N) in x.dtype, by the fused kernel with tiles `cfg`;
    with `partials`, the split-K partial sums (split_k, M, N) in float32. x may be a GatedX,
    whose GLU the kernel applies as it loads x; a NormedRows ("mma" tiles), whose rows' norm
    scale the kernel applies to its sums; or a PendingNorm ("fma" tiles), whose add and norm
    the kernel applies: the result is then (product, residual + sum(parts) (M, K))."""
    return _launch(x, w, cfg, interpret, partials)


@functools.partial(jax.jit, static_argnames=("cfg", "eps", "interpret"), donate_argnames=("counts",))
def fused_qmatmul_add_norm(x: jax.Array | GatedX | NormedRows, w: QTensor, cfg: TileConfig, residual: jax.Array,
                           norm_w: jax.Array, counts: jax.Array, eps: float, interpret: bool = False):
    """The product x (M, K) @ dequantize(w).T added to the residual stream (M, N) and RMS-normed
    by norm_w for the next products, in the product's kernel ("mma" tiles, one M tile) ->
    (residual + product float32, NormedRows of it in x.dtype, counts).

    The split_k programs of a weight-row tile each store their partial sums and add one to the
    tile's count (atomic, after a block barrier); the one that arrives last sums them with the
    residual and writes the new residual, that sum times the norm weight and its sums of
    squares per 32 values. The norm's scale needs the whole row, which no program sees: it is
    left to the consumer (NormedRows), one factor per row on its sums. counts: int32 zeros,
    one per weight-row tile at least, handed back zeroed (donated: a caller passes them on)."""
    n_rows = w.shape[0]
    m_rows = x.shape[0]
    tiles = pl.cdiv(n_rows, cfg.block_n)
    if cfg.method != "mma" or m_rows > cfg.block_m or n_rows % 32 or cfg.block_n % 32:
        raise ValueError(f"fused_qmatmul_add_norm: takes 'mma' tiles over one M tile, N and block_n multiples "
                         f"of 32; got {cfg} for x rows {m_rows} and weight {w.qtype.name} {w.shape}")
    if residual.shape != (m_rows, n_rows) or norm_w.shape != (n_rows,) or counts.ndim != 1 or \
            counts.shape[0] < tiles:
        raise ValueError(f"fused_qmatmul_add_norm: residual {residual.shape}, norm weight {norm_w.shape} and "
                         f"counts {counts.shape} do not match the product ({m_rows}, {n_rows}) in {tiles} tiles")
    _, x_out, xn, ss, counts = _launch(x, w, cfg, interpret, True,
                                       add_norm=(residual.astype(jnp.float32), norm_w, counts))
    return x_out, NormedRows(xn, ss, float(eps)), counts


def _launch(x, w: QTensor, cfg: TileConfig, interpret: bool, partials: bool, add_norm=None):
    """The pallas_call behind fused_qmatmul and fused_qmatmul_add_norm."""
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
    scaled = isinstance(x, NormedRows)
    if scaled and cfg.method != "mma":
        raise ValueError(f"fused_qmatmul: a NormedRows x is scaled by 'mma' tiles, got {cfg}")
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
    norm_in, norm, extra = [], None, []
    out_shapes = [out_shape]
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
        out_shapes.append(jax.ShapeDtypeStruct(x5.shape, jnp.float32))
    elif scaled:
        if k % 32 or x.ss.shape != (m_rows, k // 32):
            raise ValueError(f"fused_qmatmul: NormedRows sums of squares {x.ss.shape} for x {x.shape}")
        x5 = x.x.reshape(m_rows, *by_block)
        norm_in.append(x.ss.astype(jnp.float32))
    elif activation is None:
        x5 = x.reshape(m_rows, *by_block)
    else:
        x5 = x.gate_up.reshape(m_rows, 2, *by_block)
    aliases = {}
    if add_norm is not None:
        residual, norm_w, counts = add_norm
        extra = [residual, norm_w, counts]
        out_shapes += [jax.ShapeDtypeStruct((m_rows, n_rows), jnp.float32),
                       jax.ShapeDtypeStruct((m_rows, n_rows), x.dtype),
                       jax.ShapeDtypeStruct((m_rows, n_rows // 32), jnp.float32),
                       jax.ShapeDtypeStruct(counts.shape, counts.dtype)]
    views = fmt.views(w.planes)
    if add_norm is not None:
        aliases = {1 + len(norm_in) + len(views) + 2: len(out_shapes) - 1}
    grid = (pl.cdiv(n_rows, cfg.block_n), pl.cdiv(m_rows, cfg.block_m), cfg.split_k)
    kernel = functools.partial(
        _kernel, fmt=fmt, cfg=cfg, split_out=len(out_shape.shape) == 3, m_rows=m_rows, n_rows=n_rows,
        n_blocks=n_blocks, blocks_per_split=blocks_per_split, cdt=compute_dtype(x.dtype), activation=activation,
        norm=norm, row_scale=float(x.eps) if scaled else None, add_norm=add_norm is not None, interpret=interpret)
    wbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in views)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=pl.CostEstimate(
            flops=2 * m_rows * w.shape[0] * k, transcendentals=0,
            bytes_accessed=wbytes * grid[1] + x5.size * x5.dtype.itemsize * grid[0]
            + m_rows * n_rows * jnp.dtype(out_shape.dtype).itemsize * cfg.split_k),
        interpret=interpret,
        name=f"qmatmul_{w.qtype.name.lower()}" + ("_norm" if pending else "") + ("_add_norm" if add_norm else ""),
    )(x5, *norm_in, *views, *extra)
    if add_norm is not None:
        return out
    if pending:
        out, residual = out[0], out[1].reshape(m_rows, k)
    else:
        out, residual = out[0], None
    if cfg.split_k > 1 and not partials:
        out = out.sum(axis=0).astype(x.dtype)
    return out if residual is None else (out, residual)

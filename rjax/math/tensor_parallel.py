"""Tensor parallelism over a `tp` mesh axis (Megatron-style), on XLA's collectives.

Layout (`param_specs`): q, k, v and gate, up are split by output rows (attention heads, FFN
hidden units), the output and down products by input columns (whole GGUF blocks of them), each
of those two followed by one all-reduce; a mixture of experts splits every expert's FFN hidden
units the same way (its one all-reduce after the weighted sum of the chosen experts), the router
replicated, so every device routes alike; the LM head is split over the vocabulary where it
divides; norms and the embedding are replicated. The KV cache is split by KV heads
(`cache_specs`).

Heads that do not divide the devices are padded (`head_layout`): a padded q head has zero q
rows and zero output columns, a padded KV head zero k/v rows, so they add nothing; where there
are fewer KV heads than devices, each KV head is copied onto the devices whose q heads read it.
After that every device holds the same number of q and KV heads in the usual grouped order, so
the model runs unchanged on each device's shard: `hidden_states` and `logits` run the
single-device functions under `jax.shard_map` (the Pallas kernels see their shard as a whole
array), and the plan (`plan_for(tp_axis=...)`) puts a `psum` after each row-parallel product
instead of fusing it into the next norm. Outputs leave the shard_map replicated (the hidden
states) or split over the vocabulary (the logits), so an argmax or a sample over them is
reduced by XLA without gathering full logits.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gguf import GGML_QUANT_SIZES

from gguf_blocks import reference
from gguf_blocks.qtensor import QTensor
from rjax.math.config import ModelConfig

# Products split by output rows (column-parallel) and by input columns (row-parallel).
ROW_SPLIT = frozenset({"wq", "wk", "wv", "wqkv", "w_gate", "w_up", "w_gate_up", "bq", "bk", "bv"})
COL_SPLIT = frozenset({"wo", "w_down"})
# A mixture's experts (E, out, in), each expert's F split as a dense MLP's is: gate and up by
# their rows (axis 1), down by its columns (axis 2); the router stays whole on every device.
EXPERT_ROWS = frozenset({"w_gate_exps", "w_up_exps"})
EXPERT_COLS = frozenset({"w_down_exps"})


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A one-axis device mesh the model's params and caches are split over (static, hashable)."""

    mesh: Mesh
    axis: str = "tp"

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def make_tp(n: int, devices=None) -> TensorParallel:
    """A `tp` mesh over the first n devices (ValueError naming how many there are)."""
    devices = jax.devices() if devices is None else list(devices)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tp must be an integer >= 1, got {n!r}")
    if n > len(devices):
        raise ValueError(f"tp={n} needs {n} devices; this process sees {len(devices)} "
                         f"({devices[0].platform})")
    return TensorParallel(Mesh(np.array(devices[:n]), ("tp",)))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where each head of the split model comes from: an original head index, or None (zeros)."""

    q: tuple[int | None, ...]
    kv: tuple[int | None, ...]

    @property
    def identity(self) -> bool:
        return self.q == tuple(range(len(self.q))) and self.kv == tuple(range(len(self.kv)))


def head_layout(n_heads: int, n_kv_heads: int, n: int) -> HeadLayout:
    """Heads for n devices, each holding n_heads' / n q heads and n_kv_heads' / n KV heads, q
    heads grouped by their KV head as before. KV heads are padded to a multiple of n; fewer KV
    heads than devices are padded to a divisor of n and each copied onto n / that many devices,
    each copy serving an equal share of its group's q heads (a group padded to divide)."""
    group = n_heads // n_kv_heads
    if n_kv_heads >= n:
        kv_pad = -(-n_kv_heads // n) * n
        kv = tuple(j if j < n_kv_heads else None for j in range(kv_pad))
        q = tuple(j * group + i if j < n_kv_heads else None for j in range(kv_pad) for i in range(group))
        return HeadLayout(q, kv)
    kv_pad = next(d for d in range(n_kv_heads, n + 1) if n % d == 0)
    copies = n // kv_pad
    per = -(-group // copies)  # q heads per device
    kv, q = [], []
    for d in range(n):
        j, part = divmod(d, copies)
        kv.append(j if j < n_kv_heads else None)
        q += [j * group + i if j < n_kv_heads and i < group else None
              for i in range(part * per, (part + 1) * per)]
    return HeadLayout(tuple(q), tuple(kv))


def split_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model as the n devices hold it together: its heads padded as `head_layout` says."""
    lay = head_layout(cfg.n_heads, cfg.n_kv_heads, n)
    if cfg.n_experts and cfg.expert_d_ff % n:
        raise ValueError(f"tp={n}: the experts' feed-forward size {cfg.expert_d_ff} (expert_d_ff) does not split "
                         f"into {n} equal parts")
    if not cfg.n_experts and cfg.d_ff % n:
        raise ValueError(f"tp={n}: the feed-forward size {cfg.d_ff} does not split into {n} equal parts")
    return dataclasses.replace(cfg, n_heads=len(lay.q), n_kv_heads=len(lay.kv))


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """One device's part of a split config (`split_config`)."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // n, n_kv_heads=cfg.n_kv_heads // n, d_ff=cfg.d_ff // n,
                               expert_d_ff=cfg.expert_d_ff // n)


# -- rearranging weights ------------------------------------------------------------------------

def _rows(w, index: np.ndarray):
    """Rows `index` of w (a QTensor's planes, or a dense [out, ...] array); -1: a zero row."""
    keep = index >= 0
    idx = np.where(keep, index, 0)

    def take(a):
        a = np.asarray(a)[idx]
        a[~keep] = 0
        return a

    if isinstance(w, QTensor):
        return QTensor(jax.tree.map(take, w.planes), w.qtype, (len(index), w.shape[1]))
    return take(w)


def _columns(w, index: np.ndarray, width: int):
    """Columns of w [out, in] in groups of `width` (one head): group g of the result is group
    index[g] of w, or zeros for -1. A quantized w moves whole blocks when a head is whole blocks,
    else it is dequantized (float32) first."""
    if isinstance(w, QTensor):
        block = GGML_QUANT_SIZES[w.qtype][0]
        if width % block:
            w = np.asarray(reference.dequantize(w))
        else:
            per = width // block
            cols = np.concatenate([np.arange(g * per, (g + 1) * per) if g >= 0 else np.full(per, -1)
                                   for g in index])
            keep, idx = cols >= 0, np.where(cols >= 0, cols, 0)

            def take(a):
                a = np.asarray(a)[:, idx]
                a[:, ~keep] = 0
                return a

            return QTensor(jax.tree.map(take, w.planes), w.qtype, (w.shape[0], len(index) * width))
    cols = np.concatenate([np.arange(g * width, (g + 1) * width) if g >= 0 else np.full(width, -1) for g in index])
    keep, idx = cols >= 0, np.where(cols >= 0, cols, 0)
    out = np.asarray(w)[:, idx]
    out[:, ~keep] = 0
    return out


def _head_rows(heads, head_dim: int, offset: int = 0) -> np.ndarray:
    return np.concatenate([np.arange(offset + h * head_dim, offset + (h + 1) * head_dim) if h is not None
                           else np.full(head_dim, -1) for h in heads]).astype(np.int64)


def _interleave(parts: list[np.ndarray], n: int) -> np.ndarray:
    """Row indices of a stacked weight [a; b; ...] reordered so that device d's rows are
    [a_d; b_d; ...]: each device's shard is the stacked weight of its own rows."""
    return np.concatenate([np.concatenate([np.array_split(p, n)[d] for p in parts]) for d in range(n)])


def split_layer(cfg: ModelConfig, p, n: int):
    """One LayerParams rearranged for n devices (host arrays; `place_params` moves them)."""
    lay = head_layout(cfg.n_heads, cfg.n_kv_heads, n)
    D, F = cfg.head_dim, cfg.d_ff
    q_rows = _head_rows(lay.q, D)
    kv_rows = _head_rows(lay.kv, D)
    out = {}
    if p.wqkv is not None:
        qd, kd = cfg.n_heads * D, cfg.n_kv_heads * D
        out["wqkv"] = _rows(p.wqkv, _interleave([q_rows, kv_rows + qd, kv_rows + qd + kd], n))
    else:
        out.update(wq=_rows(p.wq, q_rows), wk=_rows(p.wk, kv_rows), wv=_rows(p.wv, kv_rows))
    if p.bq is not None:
        out.update(bq=_rows(p.bq, q_rows), bk=_rows(p.bk, kv_rows), bv=_rows(p.bv, kv_rows))
    out["wo"] = p.wo if lay.identity else _columns(p.wo, np.array([-1 if h is None else h for h in lay.q]), D)
    if p.w_gate_up is not None:
        out["w_gate_up"] = _rows(p.w_gate_up, _interleave([np.arange(F), np.arange(F, 2 * F)], n))
    down = p.w_down_exps
    if isinstance(down, QTensor) and (cfg.expert_d_ff // n) % GGML_QUANT_SIZES[down.qtype][0]:
        # a device's share of each expert's columns is not whole blocks: split the values instead
        out["w_down_exps"] = np.asarray(reference.dequantize(down))
    return dataclasses.replace(p, **out)


# -- placing ------------------------------------------------------------------------------------

def _field(path) -> str | None:
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    return next((nm for nm in names if nm in ROW_SPLIT | COL_SPLIT | EXPERT_ROWS | EXPERT_COLS | {"lm_head"}), None)


def param_specs(params, tp: TensorParallel):
    """A PartitionSpec per leaf of params (QTensor planes: rows on axis 0, blocks on axis 1;
    stacked experts' planes: experts, rows, blocks)."""
    def spec(path, leaf):
        field = _field(path)
        if field in ROW_SPLIT or (field == "lm_head" and leaf.shape[0] % tp.size == 0):
            return P(tp.axis, *[None] * (leaf.ndim - 1))
        if field in COL_SPLIT | EXPERT_ROWS:
            return P(None, tp.axis, *[None] * (leaf.ndim - 2))
        if field in EXPERT_COLS:
            return P(None, None, tp.axis, *[None] * (leaf.ndim - 3))
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def head_split(params) -> bool:
    """Whether the LM head's logits come out split over the vocabulary."""
    head = params.lm_head
    return head is not None and head.shape[0] % params.tp.size == 0


def cache_specs(cache, tp: TensorParallel):
    """A PartitionSpec per leaf of a KV cache: K/V and their per-entry scales by KV head,
    per-head (fp8) scales and the decode kernel's split counts (`arrivals`, [n_slots, Hkv])
    likewise; lengths and block tables replicated."""
    head = 2 if cache.paged else 1
    k_ndim = jax.tree.leaves(cache.k)[0].ndim

    def spec(path, leaf):
        names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
        name = names[0] if names else ""
        if name in ("k", "v"):
            axis = head
        elif name in ("k_scale", "v_scale"):
            axis = head if leaf.ndim == k_ndim - 1 else leaf.ndim - 1
        elif name == "arrivals":
            axis = 1
        else:
            return P()
        return P(*[None] * axis, tp.axis)

    return jax.tree_util.tree_map_with_path(spec, cache)


def place(tree, specs, tp: TensorParallel):
    """device_put every leaf of tree with its spec: each device receives only its shard."""
    return jax.tree.map(lambda x, s: jax.device_put(x, tp.sharding(s)), tree, specs)


def place_cache(cache, tp: TensorParallel | None):
    return cache if tp is None else place(cache, cache_specs(cache, tp), tp)


def abstract_cache(cache, tp: TensorParallel | None):
    """A ShapeDtypeStruct tree of a cache as `place_cache` lays it out (for compiling ahead)."""
    if tp is None:
        return cache
    return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tp.sharding(spec)),
                        cache, cache_specs(cache, tp))


def per_device_bytes(tree) -> int:
    """Bytes the fullest device holds of tree's arrays."""
    used: dict = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            used[s.device] = used.get(s.device, 0) + s.data.nbytes
    return max(used.values()) if used else 0


# -- running ------------------------------------------------------------------------------------

def _local(params):
    """Params as one device sees its shard inside shard_map: a plain one-device model whose
    quantized weights say their shard's shape."""
    n = params.tp.size

    def shape(path, w):
        if not isinstance(w, QTensor):
            return w
        field = _field(path)
        *experts, rows, cols = w.shape
        if field in ROW_SPLIT | EXPERT_ROWS or (field == "lm_head" and rows % n == 0):
            rows //= n
        elif field in COL_SPLIT | EXPERT_COLS:
            cols //= n
        return QTensor(w.planes, w.qtype, (*experts, rows, cols))

    local = jax.tree_util.tree_map_with_path(shape, params, is_leaf=lambda x: isinstance(x, QTensor))
    return dataclasses.replace(local, tp=None)


def hidden_states(fn, cfg: ModelConfig, params, cache, tokens, pos, slots, dtype, tuning):
    """fn (the single-device `model.hidden_states`) on every device's shard, the row-parallel
    products all-reduced over the mesh axis. -> (hidden states, replicated; the cache)."""
    tp = params.tp
    local_cfg = local_config(cfg, tp.size)
    specs = (param_specs(params, tp), cache_specs(cache, tp), P(), P(), None if slots is None else P())

    def run(params, cache, tokens, pos, slots):
        return fn(local_cfg, _local(params), cache, tokens, pos, slots, dtype, tuning=tuning, tp_axis=tp.axis)

    return jax.shard_map(run, mesh=tp.mesh, in_specs=specs, out_specs=(P(), specs[1]), check_vma=False)(
        params, cache, tokens, pos, slots)


def logits(fn, params, h):
    """fn (the single-device `model.logits_from_hidden`) per device: logits split over the
    vocabulary where the LM head is, else replicated."""
    tp = params.tp
    out = P(*[None] * (h.ndim - 1), tp.axis) if head_split(params) else P()
    return jax.shard_map(lambda params, h: fn(_local(params), h), mesh=tp.mesh,
                         in_specs=(param_specs(params, tp), P()), out_specs=out, check_vma=False)(params, h)


def describe(cfg: ModelConfig, n: int) -> str:
    lay = head_layout(cfg.n_heads, cfg.n_kv_heads, n)
    pad_q = sum(h is None for h in lay.q)
    return (f"tp={n}: {len(lay.q) // n} q and {len(lay.kv) // n} KV heads per device"
            + (f" ({pad_q} q heads padded, KV heads {cfg.n_kv_heads} -> {len(lay.kv)})" if not lay.identity else "")
            + (f", {cfg.n_experts} experts of FFN {cfg.expert_d_ff // n} per device" if cfg.n_experts
               else f", FFN {cfg.d_ff // n} per device"))


__all__ = ["TensorParallel", "make_tp", "HeadLayout", "head_layout", "split_config", "local_config", "split_layer",
           "param_specs", "cache_specs", "place", "place_cache", "abstract_cache", "per_device_bytes", "hidden_states", "logits",
           "describe"]

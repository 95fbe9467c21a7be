"""Loaded params arranged for the GPU decode kernels: the same values in fewer, larger products
and in the layouts the kernels read fastest. Applied once at load (`rjax.loading.loaders.for_backend`)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gguf_blocks.qtensor import QTensor, Weight
from gguf_blocks.reference import q4_k_chunks
from gguf_blocks.words import as_words
from pallas_kernels.quant_matmul.gemv import reads_words
from rjax.math import tensor_parallel as tpl
from rjax.math.config import ModelConfig
from rjax.math.params import Params


# The conversions below run as one jitted program per weight (a few distinct shapes per model):
# run eagerly, each of their operations was a program of its own, read back from the compile
# cache and dispatched once per weight, which was most of a GPU model's load.
@jax.jit
def _concatenate_rows(ws: list[Weight]) -> Weight:
    if isinstance(ws[0], QTensor):
        planes = jax.tree.map(lambda *p: jnp.concatenate(p, axis=0), *[w.planes for w in ws])
        return QTensor(planes, ws[0].qtype, (sum(w.shape[0] for w in ws), ws[0].shape[1]))
    return jnp.concatenate(ws, axis=0)


def _stack_rows(ws: list[Weight]) -> Weight | None:
    """Weights (n_i, K) of one type -> one weight (sum n_i, K); None if their types differ."""
    if all(isinstance(w, QTensor) for w in ws):
        if len({(w.qtype, w.shape[1]) for w in ws}) != 1:
            return None
        return _concatenate_rows(ws)
    if any(isinstance(w, QTensor) for w in ws) or len({(w.dtype, w.shape[1]) for w in ws}) != 1:
        return None
    return _concatenate_rows(ws)


def _gpu_layout(w: QTensor) -> QTensor:
    """The GPU layout of one weight, as `gpu_weight_layout` describes it."""
    new = q4_k_chunks(w)
    return as_words(new) if reads_words(new.qtype, *new.shape) else new


@functools.partial(jax.jit, static_argnames="kept")
def _gpu_planes(w: QTensor, kept: frozenset) -> dict:
    return {f: p for f, p in _gpu_layout(w).planes._asdict().items() if f not in kept}


def _gpu_weight(w: QTensor) -> QTensor:
    """`_gpu_layout(w)`, computing only the planes it changes: those it keeps (a Q4_K's scales,
    a weight it leaves as it is) stay the same arrays, where XLA would copy them."""
    want = jax.eval_shape(jax.jit(_gpu_layout), w)
    same = lambda a, b: a.shape == b.shape and a.dtype == b.dtype  # noqa: E731
    kept = frozenset(f for f, p in want.planes._asdict().items()
                     if f in w.planes._fields and same(p, getattr(w.planes, f)))
    if type(want.planes) is type(w.planes) and len(kept) == len(w.planes):
        return w
    made = _gpu_planes(w, kept)
    planes = type(want.planes)(**{f: getattr(w.planes, f) if f in kept else made[f] for f in want.planes._fields})
    return QTensor(planes, want.qtype, want.shape)


def _fuse_layer(p):
    if p.wqkv is None and (qkv := _stack_rows([p.wq, p.wk, p.wv])) is not None:
        p = dataclasses.replace(p, wqkv=qkv, wq=None, wk=None, wv=None)
    if p.w_gate is not None and p.w_gate_up is None and (gu := _stack_rows([p.w_gate, p.w_up])) is not None:
        p = dataclasses.replace(p, w_gate_up=gu, w_gate=None, w_up=None)
    return p


def fuse_projections(params: Params) -> Params:
    """Stack each layer's q, k, v weights into `wqkv` and gate, up into `w_gate_up` where they
    share a type (a Q4_K_M file's Q6_K v stays apart): the same products in fewer, larger
    matmuls, which is what decoding small batches on a GPU is bound by (one kernel launch and
    one pass over the activations per matmul). Layer by layer, so the extra memory while
    fusing is one layer's projections."""
    return dataclasses.replace(params, layers=tuple(_fuse_layer(p) for p in params.layers))


def gpu_weight_layout(params: Params, *, consume: bool = False) -> Params:
    """The same values in the layout the GPU decode kernels read fastest: every Q4_K weight's
    packed 6-bit scales re-encoded per quant chunk (`Q4_KChunks`: fewer loads and integer
    ops; 3% more bytes), and the quant planes of the weights whose kernels read words faster
    viewed as int32 words (gguf_blocks.words, `gemv.reads_words`).

    consume: the params are the caller's to give up (a loader's own): each weight's replaced
    planes are freed once its new ones are made, so the device holds at most one weight twice
    instead of every converted weight (llama-8b Q4_0: a peak of 11.1 GiB otherwise, 7.4 with
    the file's layout)."""
    done: dict[int, Weight] = {}  # a weight met twice (tied) is converted, and freed, once

    def convert(w):
        if not isinstance(w, QTensor) or len(w.shape) != 2:  # stacked experts: read by XLA, as loaded
            return w
        if id(w) not in done:
            new = _gpu_weight(w)
            if consume and new is not w:
                kept = {id(x) for x in jax.tree.leaves(new.planes)}
                for x in jax.tree.leaves(w.planes):
                    if isinstance(x, jax.Array) and id(x) not in kept:
                        x.delete()
            done[id(w)] = new
        return done[id(w)]

    return jax.tree.map(convert, params, is_leaf=lambda x: isinstance(x, QTensor))


def split_model(cfg: ModelConfig, params: Params, tp: tpl.TensorParallel, *, fuse: bool,
                progress: bool = False) -> tuple[ModelConfig, Params]:
    """The model split over tp's devices (rjax.math.tensor_parallel): heads padded where they do not
    divide, each layer's weights (stacked first with `fuse`) rearranged so that every device's
    shard is a whole model of its own heads, and put straight into their shards, layer by
    layer, so no device holds more than its share and one layer. -> (the split config, params)."""
    from tqdm import tqdm

    n = tp.size
    split_cfg = tpl.split_config(cfg, n)
    layers = []
    for p in tqdm(params.layers, desc=f"splitting over {n} devices", unit="layer", disable=not progress, leave=False):
        if fuse:
            p = _fuse_layer(p)
        p = tpl.split_layer(cfg, p, n)
        layers.append(tpl.place(p, tpl.param_specs(p, tp), tp))
    top = dataclasses.replace(params, layers=(), tp=tp)
    top = tpl.place(top, tpl.param_specs(top, tp), tp)
    return split_cfg, dataclasses.replace(top, layers=tuple(layers))

"""The fusion plan: for one model, batch shape, cache, dtype and backend, which kernel takes each
product and the attention, and which norms and GLUs are left to the kernel of the product that
consumes them.

`plan_for` is the one place these choices are made, the attention's included: which kernel
rotates q/k and writes the chunk's K/V into the cache, and which attends (`AttentionKernel`,
chosen from the chunk's shape and the cache's kind, length and dtype). `rjax.math.ops` follows the
plan it is given and hands the caches its choices, which they pass on to the kernel entry
points; `rjax.math.model` only passes each layer's plan to the ops. The questions it asks
(`kernel_for`, `takes_pending_norm`, `attention_kernel`, ...) are answered by the kernel packages,
the products' from their `Tuning`, the thresholds measured on the H100; a benchmark or test that
wants other choices passes its own `Tuning`. `rjax info MODEL --plan --rows N` prints a plan.

How a layer's q/k/v reach the cache (`Attention`):
- "rope_attention": rotated, appended and attended in one kernel (one token per sequence);
- "rope_append": rotated and appended by kv_append's kernel from the product's partial sums,
  then attended by the `attend` kernel;
- "rope_append_xla": the same in XLA (kv_append's reference: a CPU plan, or more tokens than
  the kernel takes);
- "xla": the summed product rotated and written by XLA ops (no fused q/k/v weight).

Where a norm can run (`Norm`):
- "norm": the residual add + RMS norm kernel (or XLA's fusion), its output plain;
- "norm_int8": the same kernel, its output rounded to int8 for int8 products;
- "product": the product before the norm adds its output to the residual and norms the sum in
  its own kernel (int8 GEMV at one row), the normed rows rounded to int8 with the scale pending;
- "product_rows": the same on the float kernel's tensor-core tiles (a few rows: a speculative
  verification's positions, a small batch), the normed rows in the activations' dtype with the
  scale pending (NormedRows) for products on those tiles;
- "pending": left to the one product after it, whose kernel sums, norms and multiplies.
Where the GLU act(gate) * up runs (`Glu`): "xla" (a fusion of its own), "int8" (the kernel that
rounds x for an int8 down product), or "down" (the down product applies it as it loads x).
A mixture of experts' products (`gate_up`, `down`) name the form its chosen experts run in
(`experts_form`): "gather" or "grouped", both XLA today.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from pallas_kernels import quant_matmul as qm
from pallas_kernels.attention import MAX_DECODE_TOKENS, AttentionKernel, attention_kernel, takes_decode
from pallas_kernels.kv_append import MAX_ROWS as APPEND_MAX_ROWS
from pallas_kernels.quant_matmul import TUNING, Tuning
from rjax.math.config import ModelConfig

# What runs the planned kernels: compiled for the GPU, in Pallas' interpreter, or their references.
Implementation = Literal["pallas", "interpret", "reference"]


class Attention(enum.StrEnum):
    """How a layer's q/k/v are rotated and written into the cache (see the module docstring)."""
    ROPE_ATTENTION = "rope_attention"
    ROPE_APPEND = "rope_append"
    ROPE_APPEND_XLA = "rope_append_xla"
    XLA = "xla"


class Norm(enum.StrEnum):
    """Where a residual add + RMS norm runs (see the module docstring)."""
    NORM = "norm"
    NORM_INT8 = "norm_int8"
    PRODUCT = "product"
    PRODUCT_ROWS = "product_rows"
    PENDING = "pending"


class Glu(enum.StrEnum):
    """Where act(gate) * up runs: an XLA fusion, the int8 rounding kernel, or the down product."""
    XLA = "xla"
    INT8 = "int8"
    DOWN = "down"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    qkv: str            # kernel of the q/k/v product(s)
    attention: Attention
    attn_out_int8: bool  # the attention kernel rounds its output to int8 for the output product
    o: str
    ffn_norm: Norm      # where the add + norm after attention runs
    gate_up: str
    glu: Glu
    down: str
    out_norm: Norm      # where the add + norm after the FFN runs (into the next layer, or the final norm)
    # The kernel that attends after the chunk is written (None: rope_attention attends itself).
    attend: AttentionKernel | None = None

    def row(self) -> tuple[str, ...]:
        attention = self.attention + ("" if self.attend is None else f"/{self.attend}")
        return (self.qkv, attention + ("+int8" if self.attn_out_int8 else ""), self.o, self.ffn_norm,
                self.gate_up, self.glu, self.down, self.out_norm)


@dataclasses.dataclass(frozen=True)
class Plan:
    batch: int
    tokens: int
    dtype: str
    gpu: bool
    paged: bool
    slots: bool
    implementation: Implementation
    first_norm: Norm
    layers: tuple[LayerPlan, ...]
    head: str
    tuning: Tuning = TUNING
    # The mesh axis a split model's row-parallel products (output, down) are summed over.
    tp_axis: str | None = None
    # Each layer as calls of computations the layers share (rjax.math.model), so that XLA compiles a
    # layer once, not once per layer: on the XLA path (no kernels; split models too), where no kernel
    # needs a layer's cache whole inside its own program.
    layer_calls: bool = False

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    @property
    def counts(self) -> bool:
        """Whether some product fuses an add + norm (and needs its zeroed group counts)."""
        return any(how in (Norm.PRODUCT, Norm.PRODUCT_ROWS) for lp in self.layers for how in (lp.ffn_norm, lp.out_norm))

    def __str__(self) -> str:
        head = ("layers", "q/k/v", "attention", "o", "ffn norm", "gate/up", "glu", "down", "out norm")
        groups: list[list] = []
        for i, lp in enumerate(self.layers):
            if groups and groups[-1][1] == lp.row():
                groups[-1][0][1] = i
            else:
                groups.append([[i, i], lp.row()])
        rows = [head] + [(f"{a}" if a == b else f"{a}-{b}", *r) for (a, b), r in groups]
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = [f"plan: {self.batch} x {self.tokens} tokens, {self.dtype}, {'gpu' if self.gpu else 'cpu'}"
                 f"{', paged' if self.paged else ''}{', slots' if self.slots else ''}, {self.implementation}"
                 f"{', layer calls' if self.layer_calls else ''}"
                 f"; first norm {self.first_norm}; head {self.head}"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)


def _norm_into(w_before, post_norm, consumers, rows, dtype, kw) -> Norm:
    """Where the residual add + norm between the product `w_before` and the products
    `consumers` runs (None consumers: the final norm, before the LM head)."""
    if consumers is None:
        return Norm.NORM
    if post_norm is None and qm.fuses_add_norm(w_before, rows, dtype, consumers, **kw):
        return Norm.PRODUCT
    if post_norm is None and qm.fuses_add_norm_rows(w_before, rows, dtype, consumers, **kw):
        return Norm.PRODUCT_ROWS
    if len(consumers) == 1 and qm.takes_pending_norm(consumers[0], rows, dtype, **kw):
        return Norm.PENDING
    return _plain_norm(consumers, rows, dtype, kw)


def _plain_norm(consumers, rows, dtype, kw) -> Norm:
    """The norm kernel, its output rounded to int8 where every consumer wants it so."""
    ok = consumers is not None and all(qm.takes_quantized_x(c, rows, dtype, **kw) for c in consumers)
    return Norm.NORM_INT8 if ok else Norm.NORM


def _rotates_in_kernel(p) -> bool:
    """Whether a layer's attention takes its QKV product whole into the kernels that rotate and
    append (a fused QKV weight; per-head q/k norms are applied there)."""
    return p.wqkv is not None


def _qkv_weights(p) -> list:
    return [p.wqkv] if p.wqkv is not None else [p.wq, p.wk, p.wv]


def _ffn_weights(p) -> list:
    return [p.w_gate_up] if p.w_gate_up is not None else [p.w_gate, p.w_up]


def _kernels(ws, rows, dtype, kw) -> str:
    return "/".join(dict.fromkeys(qm.kernel_for(w, rows, dtype, **kw) for w in ws))


def plan_for(cfg: ModelConfig, params, batch: int, tokens: int, dtype, *, paged: bool = False, slots: bool = False,
             gpu: bool | None = None, implementation: Implementation | None = None, tuning: Tuning = TUNING,
             tp_axis: str | None = None, cache_len: int | None = None, cache_dtype=None) -> Plan:
    """The plan of a forward pass of `batch` sequences x `tokens` tokens in `dtype` over `params`
    (their types and shapes only), on a paged or contiguous cache, with cache rows given
    (`slots`) or rows 0..batch-1; `cache_len` positions per row of a cache stored in `cache_dtype`
    (default `dtype`; None length: a prefill over a contiguous cache is planned on the Triton
    kernel, which takes any). `gpu`: plan for a GPU backend (default: the current one);
    `implementation`: what runs the planned kernels (default: "pallas" on a GPU plan, else
    "reference"; "interpret" or "reference" run a GPU plan on a CPU, for tests). An int8 or fp8
    cache is written quantized by the kernels that rotate and append. tp_axis: plan one
    device's shard of a split model, whose output and down products are summed across that mesh
    axis before the norm after them, so neither fuses its add + norm nor leaves the norm pending."""
    gpu = jax.default_backend() == "gpu" if gpu is None else gpu
    implementation = implementation or ("pallas" if gpu else "reference")
    if implementation not in get_args(Implementation):
        raise ValueError(f"plan_for: implementation={implementation!r} is not one of {get_args(Implementation)}")
    dtype = jnp.dtype(dtype)
    rows = batch * tokens
    kw = dict(gpu=gpu, tuning=tuning)
    attend = attention_kernel(tokens, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, gpu=gpu, paged=paged, dtype=dtype,
                              cache_dtype=cache_dtype, cache_len=cache_len)
    layers = params.layers
    plans = []
    for i, p in enumerate(layers):
        if not _rotates_in_kernel(p):
            attention = Attention.XLA
        elif (paged or not slots) and gpu and tokens == 1 and batch <= tuning.fused_rope_max_rows:
            # A paged cache's kernel finds each sequence's pages through its table, so it takes
            # any slots; a contiguous cache's writes rows 0..B-1.
            attention = Attention.ROPE_ATTENTION
        elif gpu and rows <= APPEND_MAX_ROWS:
            attention = Attention.ROPE_APPEND
        else:
            attention = Attention.ROPE_APPEND_XLA
        layer_attend = None if attention == Attention.ROPE_ATTENTION else attend
        attn_out_int8 = (attention == Attention.ROPE_ATTENTION and tuning.quantized_attention_out
                         and cfg.head_dim % 32 == 0 and qm.runs_int8_gemv(p.wo, rows, dtype, **kw))
        if p.router is not None:  # a mixture of experts: its products run in XLA on plain normed rows
            form = experts_form(rows, cfg.n_experts_used, cfg.n_experts)
            plans.append(LayerPlan(
                qkv=_kernels(_qkv_weights(p), rows, dtype, kw), attention=attention, attn_out_int8=attn_out_int8,
                o=qm.kernel_for(p.wo, rows, dtype, **kw), ffn_norm=Norm.NORM, gate_up=form, glu=Glu.XLA,
                down=form, out_norm=Norm.NORM, attend=layer_attend))
            continue
        ffn_in = _ffn_weights(p)
        ffn_norm = _norm_into(p.wo, p.post_attn_norm, ffn_in, rows, dtype, kw)
        if p.w_gate_up is None:
            glu = Glu.XLA
        elif qm.takes_quantized_x(p.w_down, rows, dtype, **kw):
            glu = Glu.INT8
        elif qm.takes_gated_x(p.w_down, rows, dtype, **kw):
            glu = Glu.DOWN
        else:
            glu = Glu.XLA
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            consumers = _qkv_weights(nxt)
            out_norm = _norm_into(p.w_down, p.post_ffn_norm, consumers, rows, dtype, kw)
            if out_norm == Norm.PENDING and not _rotates_in_kernel(nxt):
                out_norm = Norm.NORM  # the next attention needs q/k/v whole: its product cannot apply the norm
        else:
            out_norm = Norm.NORM
        if tp_axis is not None:
            ffn_norm = _summed_first(ffn_norm, ffn_in, rows, dtype, kw)
            out_norm = _summed_first(out_norm, _qkv_weights(layers[i + 1]) if i + 1 < len(layers) else None,
                                     rows, dtype, kw)
        plans.append(LayerPlan(
            qkv=_kernels(_qkv_weights(p), rows, dtype, kw), attention=attention, attn_out_int8=attn_out_int8,
            o=qm.kernel_for(p.wo, rows, dtype, **kw), ffn_norm=ffn_norm, gate_up=_kernels(ffn_in, rows, dtype, kw),
            glu=glu, down=qm.kernel_for(p.w_down, rows, dtype, **kw), out_norm=out_norm, attend=layer_attend))
    first_norm = _plain_norm(_qkv_weights(layers[0]), rows, dtype, kw)
    head = params.embed if params.lm_head is None else params.lm_head
    return Plan(batch, tokens, dtype.name, gpu, paged, slots, implementation, first_norm, tuple(plans),
                qm.kernel_for(head, rows, dtype, **kw), tuning, tp_axis,
                layer_calls=not gpu and implementation == "reference")


def experts_form(rows: int, k: int, n_experts: int) -> str:
    """How a mixture's chosen experts are computed for `rows` rows (rjax.math.ops.experts): "gather"
    each row's k experts' weights while that reads fewer experts than all E (decode, small
    batches), else "grouped" (rows sorted by expert, each expert's weights read once)."""
    return "gather" if rows * k < n_experts else "grouped"


def decode_positions(cfg: ModelConfig) -> int:
    """The most query positions per sequence that this model's attention runs on the decode
    kernel (more go to the prefill kernels): 8, or up to 16 while its tile holds them. A
    speculative verification of up to this many positions costs about one decode step."""
    return max(T for T in range(1, MAX_DECODE_TOKENS + 1) if takes_decode(T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim))


def _summed_first(how: Norm, consumers, rows, dtype, kw) -> Norm:
    """A norm after an all-reduced product runs on its own: the product's kernel sees only this
    device's partial sum."""
    if how not in (Norm.PRODUCT, Norm.PRODUCT_ROWS, Norm.PENDING):
        return how
    return _plain_norm(consumers, rows, dtype, kw)

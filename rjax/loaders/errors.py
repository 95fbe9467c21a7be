"""`ModelFileError`, the one error a damaged or unsupported model file raises, and the checks
both loaders make before they trust what a file says.

Every message names the file and the problem (key, tensor, type, limit), so a user can tell a
truncated download from an unsupported architecture without a traceback.
"""
from __future__ import annotations

import math

import numpy as np

# Bounds on shape fields read from files, checked before anything is sized from them. Tensor
# sizes are bounded by the file's own size; these bound what only a config field sizes (per-layer
# tuples, head arithmetic): a few times the largest published models.
MAX_LAYERS = 1 << 12
MAX_DIM = 1 << 24          # hidden, intermediate, head sizes and head counts
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 30


class ModelFileError(ValueError):
    """A model file that cannot be used: the message names the file and what is wrong."""


def expected_shape(cfg, field: str) -> tuple[int, ...]:
    """The (out, in) shape a `LayerParams` / `Params` field has under `cfg`."""
    q, kv, d = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model
    return {
        "embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "final_norm": (d,),
        "attn_norm": (d,), "ffn_norm": (d,), "post_attn_norm": (d,), "post_ffn_norm": (d,),
        "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
        "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "bq": (q,), "bk": (kv,), "bv": (kv,),
        "w_gate": (cfg.d_ff, d), "w_up": (cfg.d_ff, d), "w_down": (d, cfg.d_ff),
    }[field]


def _float_arrays(weight) -> list[np.ndarray]:
    """The float arrays of a host weight: a dense array, or a QTensor's float16 scale planes."""
    arrays = weight.planes if hasattr(weight, "planes") else (weight,)
    return [a for a in arrays if isinstance(a, np.ndarray) and (a.dtype.kind == "f" or a.dtype.name == "bfloat16")]


def check_finite(where, name: str, weight) -> None:
    """Raise a ModelFileError naming `name` if a host weight holds NaN or Inf.

    A float64 sum of finite float16/bfloat16/float32 values cannot overflow, so the sum is finite
    exactly when every value is: one buffered pass over the (memory-mapped) data, no mask array."""
    for a in _float_arrays(weight):
        with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf is the NaN this looks for
            total = float(np.sum(a, dtype=np.float64))
        if a.size and not math.isfinite(total):
            bad = int(np.count_nonzero(~np.isfinite(a.astype(np.float32))))
            what = "values" if a is weight else "block scales"
            raise ModelFileError(f"{where}: tensor {name!r} has {bad:,} NaN or Inf {what} of {a.size:,}")

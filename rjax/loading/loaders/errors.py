"""`ModelFileError`, the one error a damaged or unsupported model file raises, and the checks
both loaders make before they trust what a file says.

Every message names the file and the problem (key, tensor, type, limit), so a user can tell a
truncated download from an unsupported architecture without a traceback.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

# Bounds on shape fields read from files, checked before anything is sized from them. Tensor
# sizes are bounded by the file's own size; these bound what only a config field sizes (per-layer
# tuples, head arithmetic): a few times the largest published models.
MAX_LAYERS = 1 << 12
MAX_DIM = 1 << 24          # hidden, intermediate, head sizes and head counts
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 30
MAX_JSON_DEPTH = 64        # nesting of a JSON file beside the weights; real ones need under 10


class ModelFileError(ValueError):
    """A model file that cannot be used: the message names the file and what is wrong."""


def read_json(path: str | os.PathLike):
    """A JSON file's value; a ModelFileError naming the file if it is not UTF-8 JSON or nests
    deeper than MAX_JSON_DEPTH (deeper still, the parser itself would recurse out of stack)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from e
    except RecursionError:
        raise ModelFileError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ModelFileError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


def listing(names: list[str], most: int) -> str:
    """The first `most` names, comma-separated, and how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


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

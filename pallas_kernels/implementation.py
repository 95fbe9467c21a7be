"""Which implementation a row-wise kernel entry point runs: the one rule the small kernels share."""
from __future__ import annotations

import math

import jax

IMPLEMENTATIONS = ("reference", "pallas", "interpret")


def pick_implementation(op: str, implementation: str | None, rows: int, max_rows: int) -> str:
    """None: the Pallas kernel on a GPU backend for at most `max_rows` rows (decode sizes; XLA's
    fusions do as well with many rows), the reference elsewhere. A given one is checked."""
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" and rows <= max_rows else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    return implementation


def rows_of(shape) -> int:
    """Rows of an (..., K) array: the product of its leading dims."""
    return math.prod(shape[:-1])

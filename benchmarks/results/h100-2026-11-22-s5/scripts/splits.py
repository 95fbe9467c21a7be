"""rjax CLI with the decode attention's split count forced: SPLITS=one|max (max: one key block per split)."""
import os
import sys

from jax.experimental import pallas as pl

import pallas_kernels.attention.decode as decode

mode = os.environ["SPLITS"]
if mode == "one":
    decode.default_num_splits = lambda batch, kv_heads, num_keys, block_k: 1
else:
    decode.default_num_splits = lambda batch, kv_heads, num_keys, block_k: max(
        1, min(pl.cdiv(2 * decode.NUM_SMS_H100, batch * kv_heads), num_keys // block_k))
from rjax.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))

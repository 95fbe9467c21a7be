"""Every tensor of the real GGUF models, through planes + the pure-JAX dequantizer, bit-exact
with `gguf.quants.dequantize`; plane bytes equal file bytes."""
import math
import pathlib

import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, quants

from rjax.loading.catalog import CATALOG, CatalogError, resolve_model
from gguf_blocks import formats, reference
from gguf_blocks.qtensor import QTensor

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]
CHUNK_VALUES = 1 << 22  # dequantize big tensors this many values at a time

_dequantize = jax.jit(reference.dequantize)


def model_path(name):
    """The cached catalog file, else the copy in /tmp/models; never downloads."""
    try:
        return resolve_model(name, pull_missing=False, progress=False)
    except CatalogError:
        path = pathlib.Path("/tmp/models") / CATALOG[name].file_name
        if not path.exists():
            pytest.skip(f"{name} is not downloaded")
        return path


def _chunks(t, w):
    """(reader rows, host-weight rows) pairs covering the tensor in bounded pieces."""
    rows = math.prod(w.shape[:-1])
    data = t.data.reshape(rows, -1)
    step = max(1, CHUNK_VALUES // w.shape[-1])
    for r in range(0, rows, step):
        if isinstance(w, QTensor):
            planes = jax.tree.map(lambda p: p[r:r + step], w.planes)
            part = QTensor(planes, w.qtype, (planes[0].shape[0], w.shape[-1]))
        else:
            part = w.reshape(rows, -1)[r:r + step]
        yield data[r:r + step], part


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_tensor_bit_exact(model):
    reader = GGUFReader(model_path(model))
    file_bytes = plane_bytes = 0
    types = set()
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w = formats.to_host_weight(t.name, t.tensor_type, t.data, shape)
        types.add(t.tensor_type.name)
        file_bytes += int(t.n_bytes)
        plane_bytes += w.nbytes
        assert w.nbytes == t.n_bytes, t.name
        for raw, part in _chunks(t, w):
            want = quants.dequantize(raw, t.tensor_type)
            got = np.asarray(_dequantize(part))
            assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32)), t.name
    assert plane_bytes == file_bytes
    print(f"{model}: {len(reader.tensors)} tensors, types {sorted(types)}: "
          f"planes {plane_bytes:,} bytes, file tensors {file_bytes:,} bytes")

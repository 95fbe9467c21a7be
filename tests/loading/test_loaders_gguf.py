"""The GGUF loader's device path against its host path, and the GPU layout's jitted programs
against the eager functions that define them: the same bits, leaf by leaf."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from gguf_blocks.qtensor import QTensor
from rjax.loading.loaders.gguf import load_gguf, load_params
from rjax.loading.loaders.gguf_header import config_from_reader, open_gguf


@pytest.fixture(scope="module")
def q4_k_path(tmp_path_factory):
    """Two llama-1b layers in the Q4_K_M mix: Q4_K, Q6_K and F32 tensors of a real shape."""
    from rjax.loading.synth import write_synthetic

    path = tmp_path_factory.mktemp("synth") / "q4_k_m.gguf"
    return write_synthetic(path, "llama-1b", "q4_k_m", seed=5, n_layers=2, vocab_size=512, tokenizer_from="builtin")


def _leaves(params):
    return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QTensor))


def _assert_same_bits(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


@pytest.mark.parametrize("model", ["q4_k_path", "smollm2_path"])
def test_block_bytes_split_on_the_device_give_the_host_planes(model, request):
    """on_device: each tensor's block bytes go to the device in one piece and are split into
    planes there; the host path splits them on the host. Same planes, bit for bit."""
    reader = open_gguf(request.getfixturevalue(model))
    cfg = config_from_reader(reader, model)
    device = load_params(reader, cfg, progress=False, on_device=True)
    host = load_params(reader, cfg, progress=False, on_device=False)
    types = {w.qtype for w in _leaves(host) if isinstance(w, QTensor)}
    assert types == ({QType.Q4_K, QType.Q6_K} if model == "q4_k_path" else {QType.Q4_1, QType.Q8_0})
    _assert_same_bits(device, jax.device_put(host))


def test_gpu_layout_programs_give_the_eager_layout(q4_k_path):
    """`for_backend`'s fusing and GPU layout run as jitted programs that compute only the planes
    they change: the same values as the eager functions, the planes kept being the same arrays."""
    from gguf_blocks.reference import q4_k_chunks
    from gguf_blocks.words import as_words
    from pallas_kernels.quant_matmul.gemv import reads_words
    from rjax.loading.loaders import for_backend

    _, params, _ = load_gguf(q4_k_path, progress=False)
    fused = for_backend(params, fuse=True, gpu_layout=False)
    laid = for_backend(fused, fuse=False, gpu_layout=True)
    layer, got = params.layers[0], fused.layers[0]
    for parts, stacked in (((layer.wq, layer.wk), got.wqkv), ((layer.w_gate, layer.w_up), got.w_gate_up)):
        assert stacked.shape[0] == sum(w.shape[0] for w in parts) + (stacked is got.wqkv) * layer.wv.shape[0]
        top = np.concatenate([np.asarray(w.planes.qs) for w in parts], axis=0)
        np.testing.assert_array_equal(np.asarray(stacked.planes.qs)[:top.shape[0]], top)
    converted, seen = 0, set()
    for before, after in zip(_leaves(fused), _leaves(laid)):
        if not isinstance(before, QTensor):
            assert after is before
            continue
        if (before.qtype, before.shape) not in seen:  # one program per type and shape: each checked once
            seen.add((before.qtype, before.shape))
            want = q4_k_chunks(before)
            want = as_words(want) if reads_words(want.qtype, *want.shape) else want
            _assert_same_bits(after, want)
        for name, plane in after.planes._asdict().items():
            if name in before.planes._fields and plane.dtype == getattr(before.planes, name).dtype:
                assert plane is getattr(before.planes, name)  # kept, not copied
        converted += after is not before
    assert converted >= 8  # every Q4_K matrix of the two layers, and the embedding

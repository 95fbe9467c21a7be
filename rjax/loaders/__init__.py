"""`load`: a model name, GGUF file or Hugging Face directory -> a `Model` ready to run."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path


from rjax.config import ModelConfig
from rjax.model import Params


@dataclasses.dataclass(frozen=True)
class Model:
    """What `rjax.load` returns: static config, the params pytree and the host-side tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: "object"  # rjax.tokenizer.Tokenizer
    source: Path

    @property
    def name(self) -> str:
        return self.source.name


def load(model: str | os.PathLike, *, progress: bool = True, home: str | os.PathLike | None = None,
         fuse: bool | None = None, gpu_layout: bool | None = None) -> Model:
    """Load a catalog name (pulled if missing), a `.gguf` file, or a Hugging Face directory.

    `fuse`: stack q/k/v and gate/up weights (`rjax.model.fuse_projections`). `gpu_layout`:
    re-encode Q4_K scales per quant chunk (`rjax.model.chunk_q4_k_scales`), which the GPU
    decode kernels read faster. Both default to on for a GPU backend, where fewer and larger
    decode matmuls are faster, and off elsewhere (the file's own layout)."""
    import jax

    from rjax.model import chunk_q4_k_scales, fuse_projections

    from rjax.catalog import resolve_model
    from rjax.tokenizer import Tokenizer

    path = Path(resolve_model(model, home=home))
    if path.is_dir():
        from rjax.loaders.safetensors import load_hf_dir

        cfg, params = load_hf_dir(path, progress=progress)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        from rjax.loaders.gguf import load_gguf

        cfg, params, reader = load_gguf(path, progress=progress)
        tokenizer = Tokenizer.from_gguf(reader)
    on_gpu = jax.default_backend() == "gpu"
    if fuse if fuse is not None else on_gpu:
        params = fuse_projections(params)
    if gpu_layout if gpu_layout is not None else on_gpu:
        params = chunk_q4_k_scales(params)
    return Model(cfg, params, tokenizer, path)

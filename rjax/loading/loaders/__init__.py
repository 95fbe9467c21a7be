"""`load`: a model name, GGUF file or Hugging Face directory -> a `Model` ready to run."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rjax.loading.loaders.errors import ModelFileError

if TYPE_CHECKING:  # the tokenizer and `rjax info` import this package without jax
    from rjax.math.config import ModelConfig
    from rjax.math.params import Params

__all__ = ["Model", "ModelFileError", "for_backend", "load", "start_device"]


@dataclasses.dataclass(frozen=True)
class Model:
    """What `rjax.load` returns: static config, the params pytree and the host-side tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: "object"  # rjax.loading.tokenizer.Tokenizer
    source: Path

    @property
    def name(self) -> str:
        return self.source.name


def load(model: str | os.PathLike, *, progress: bool = True, home: str | os.PathLike | None = None,
         fuse: bool | None = None, gpu_layout: bool | None = None, requantize: str | None = None,
         mesh=None) -> Model:
    """Load a catalog name (pulled if missing), a `.gguf` file, or a Hugging Face directory.

    A file or directory that cannot be used raises `ModelFileError`, whose message names the file
    and the problem; a damaged file never loads as something else.

    `fuse` and `gpu_layout`: see `for_backend`; both default to on for a GPU backend.
    `requantize` ("q8_0" or "q4_0"): every 2-D weight requantized to that type on the device
    (`gguf_blocks.requantize`) before the layout step, e.g. a lower-bit copy of a model to draft
    for it in speculative decoding.
    `mesh`: a one-axis `jax.sharding.Mesh` (or `rjax.math.tensor_parallel.TensorParallel`) to split
    the model over (tensor parallel: see rjax.math.tensor_parallel); a GGUF file's weights go from
    the mapped file straight into their shards. The returned config is the split model's (its
    heads padded where they do not divide the devices).

    Compiled programs are kept in `$RJAX_HOME/xla-cache` (under `home` if given) unless the
    process chose otherwise: see `rjax.compile_cache`."""
    start_device()
    from rjax.loading.catalog import CatalogError, resolve_model
    from rjax.loading.tokenizer import Tokenizer
    from rjax.loading.xla_cache import use_default_compile_cache

    use_default_compile_cache(home)

    try:
        path = Path(resolve_model(model, home=home))
    except CatalogError as e:
        if Path(os.fspath(model)).expanduser().is_file():  # a local file that is not a GGUF: a model-file error
            raise ModelFileError(str(e)) from e
        raise
    if path.is_dir():
        from rjax.loading.loaders.safetensors import load_hf_dir

        cfg, params = load_hf_dir(path, progress=progress)
        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        from rjax.loading.loaders.gguf import config_from_reader, load_params, open_gguf

        reader = open_gguf(path)
        cfg = config_from_reader(reader, path)
        tokenizer = Tokenizer.from_gguf(reader)  # before the weights: host work beside the device's start
        params = load_params(reader, cfg, progress, on_device=mesh is None or requantize is not None)
    if tokenizer.vocab_size > cfg.vocab_size:  # ids past the embedding would index nothing
        raise ModelFileError(f"{path}: the tokenizer has {tokenizer.vocab_size:,} tokens, but the embedding has "
                             f"{cfg.vocab_size:,} rows")
    if requantize is not None:
        from gguf_blocks.formats import TensorFormatError
        from gguf_blocks.requantize import requantize_tree

        try:
            params = requantize_tree(params, str(requantize).upper())
        except TensorFormatError as e:
            raise ValueError(f"requantize={requantize!r}: {e}") from None
    if mesh is not None:
        return Model(*split_for_backend(cfg, params, mesh, fuse=fuse, gpu_layout=gpu_layout, progress=progress),
                     tokenizer, path)
    return Model(cfg, for_backend(params, fuse=fuse, gpu_layout=gpu_layout, consume=True), tokenizer, path)


def start_device() -> None:
    """Start JAX's backend in a thread: on a GPU that is CUDA's start, over a second, which then
    runs beside the host work before the first weight goes to the device (imports, the file's
    header, the tokenizer). Calling it again costs a thread that finds the backend started."""
    import threading

    import jax  # here, not in the thread: two threads importing one package can see it half made

    threading.Thread(target=_start_backend, args=(jax,), name="rjax-device-start", daemon=True).start()


def _start_backend(jax) -> None:
    try:
        jax.devices()
    except Exception:  # noqa: BLE001 - the caller's own first use of the device reports it
        pass


def split_for_backend(cfg, params, mesh, *, fuse: bool | None = None, gpu_layout: bool | None = None,
                      progress: bool = False):
    """`for_backend` for a model split over `mesh` (a one-axis Mesh or a TensorParallel).
    -> (the split config, params)."""
    import jax
    from jax.sharding import Mesh

    from rjax.math import tensor_parallel as tpl
    from rjax.math.layout import gpu_weight_layout, split_model

    if isinstance(mesh, Mesh):
        if len(mesh.axis_names) != 1:
            raise ValueError(f"tensor parallel takes a one-axis mesh, got axes {mesh.axis_names}")
        mesh = tpl.TensorParallel(mesh, mesh.axis_names[0])
    on_gpu = jax.default_backend() == "gpu"
    cfg, params = split_model(cfg, params, mesh, fuse=fuse if fuse is not None else on_gpu, progress=progress)
    if gpu_layout if gpu_layout is not None else on_gpu:
        params = gpu_weight_layout(params, consume=True)  # split_model's own arrays
        params = tpl.place(params, tpl.param_specs(params, mesh), mesh)
    return cfg, params


def for_backend(params, *, fuse: bool | None = None, gpu_layout: bool | None = None, consume: bool = False):
    """Loaded params arranged for the default backend, the same values either way.

    `fuse`: stack q/k/v and gate/up weights (`rjax.math.layout.fuse_projections`): fewer and larger
    decode matmuls. `gpu_layout`: Q4_K scales re-encoded per quant chunk and quant planes as
    int32 words (`rjax.math.layout.gpu_weight_layout`), which the GPU decode kernels read faster. Each defaults
    to on for a GPU backend and off elsewhere (the file's own layout). consume: the params are
    the caller's to give up; the layout frees what it replaces as it goes (see gpu_weight_layout)."""
    import jax

    from rjax.math.layout import fuse_projections, gpu_weight_layout

    on_gpu = jax.default_backend() == "gpu"
    if fuse if fuse is not None else on_gpu:
        params = fuse_projections(params)
    if gpu_layout if gpu_layout is not None else on_gpu:
        params = gpu_weight_layout(params, consume=consume)
    return params

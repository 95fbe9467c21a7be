"""Device programs: `jax.jit` whose compiled executables are kept, in memory and on disk.

A jitted function traces its Python and lowers it to StableHLO before each first call in a
process; JAX's persistent compilation cache is keyed by what lowering produced, so even a warm
start pays tracing and lowering of every program (for a 30-layer model on a CPU, about as long
as reading the executable back). `DeviceProgram` keeps the executable itself: a call made
again with arguments of the same shapes, dtypes, placements and static values runs the
executable it built before, and where the persistent cache is on (`rjax.loading.xla_cache`), the
executable is also stored in its directory (`programs/`) and loaded by a later process with
no tracing at all.

A stored program's name is a digest of everything that changes it: the function, its static
arguments (model config, plan tuning, step counts, ...), the tree, shapes, dtypes and
placements of its array arguments, the jit options, the source of the packages that make up
the program (rjax, pallas_kernels, gguf_blocks), the jax and jaxlib versions, the backend and
its version, the device kind and count, and JAX's settings that change a program. The weights
are arguments, not part of the program: two files of one architecture and quantization share
their programs. A file that does not hold what its name promises (truncated, corrupt, written
by another key or version) is built again, with a log line saying why, and replaced; it is
never run.

Calls under an outer trace (a caller's own `jax.jit`, `vmap`, `grad`) go to the jitted function
as they are, and so does a call with arrays placed anywhere but the default device (parameters
split over a mesh: the jitted function places and caches those).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import pickle
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import serialize_executable

from rjax.loading.xla_cache import current_compile_cache

log = logging.getLogger("rjax.loading.programs")

FORMAT = b"RJAXPRG1"
# JAX settings that change what a traced function computes or how it is lowered.
_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
             "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion", "jax_use_shardy_partitioner")
_PACKAGES = ("rjax", "pallas_kernels", "gguf_blocks")


class _Executables:
    """The executables this process holds, by call key; emptied with JAX's own caches
    (`jax.clear_caches`), which tests call to give the memory back."""

    def __init__(self):
        self.by_key: dict = {}
        self.lock = threading.Lock()
        # One build at a time per key: threads that ask for the same program (the loader's, for
        # weights of one type and shape) wait for the first one's executable. A second,
        # concurrent compile of it would be served by JAX from the first one's work without
        # this thread seeing a persistent-cache hit, and be stored though it may not be.
        self.building: dict = {}
        try:
            from jax._src.util import register_cache
            register_cache(self, "rjax.loading.programs")
        except (ImportError, AttributeError, TypeError):
            pass  # an older JAX: they live as long as the process

    def cache_clear(self) -> None:
        self.by_key.clear()
        self.building.clear()

    def build_lock(self, key) -> threading.Lock:
        with self.lock:
            return self.building.setdefault(key, threading.Lock())

    def cache_info(self) -> str:
        return f"{len(self.by_key)} executables"


_EXECUTABLES = _Executables()


@functools.cache
def _source_digest() -> str:
    import importlib.util

    h = hashlib.sha256()
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _platform_text() -> str:
    import jaxlib

    device = jax.devices()[0]
    return "\n".join([f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}", f"platform {device.platform}",
                      f"platform_version {device.client.platform_version}", f"device {device.device_kind}",
                      f"devices {jax.device_count()}", f"sources {_source_digest()}"])


def _settings_text() -> str:
    return "\n".join([f"{name} {getattr(jax.config, name, None)!r}" for name in _SETTINGS]
                     + [f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r}"])


@functools.cache
def _default_sharding():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _leaf_signature(x) -> tuple:
    """What of an argument leaf the compiled program depends on."""
    if isinstance(x, (bool, int, float, complex)):  # becomes a weakly typed scalar
        return ("scalar", type(x).__name__)
    sharding = getattr(x, "sharding", None)
    if sharding is not None and sharding == _default_sharding():
        sharding = None  # what an abstract argument without a sharding means on one device
    return (x.shape, x.dtype, getattr(x, "weak_type", False), sharding)


class _Signature:
    """An argument's tree and its leaves' signatures, hashed once."""

    __slots__ = ("tree", "leaves", "tracer", "elsewhere", "_hash")

    def __init__(self, tree, leaves: tuple, tracer: bool = False, elsewhere: bool = False):
        self.tree, self.leaves, self.tracer, self.elsewhere = tree, leaves, tracer, elsewhere
        self._hash = hash((tree, leaves))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, _Signature) and self._hash == other._hash
                                 and self.tree == other.tree and self.leaves == other.leaves)

    def __repr__(self):
        return f"{self.tree} {self.leaves!r}"


# The signature of a large argument (the params: hundreds of leaves) is kept by the argument's
# identity: pytrees of arrays are immutable, and a model's params are passed again and again.
_LARGE = 32
_SIGNATURES: dict[int, tuple] = {}


def _signature_of(value) -> _Signature:
    entry = _SIGNATURES.get(id(value))
    if entry is not None and entry[0]() is value:
        return entry[1]
    leaves, tree = jax.tree.flatten(value)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return _Signature(tree, (), tracer=True)
    signatures = tuple(_leaf_signature(x) for x in leaves)
    # Arrays on another device or over a mesh: the jitted function places and caches those.
    found = _Signature(tree, signatures, elsewhere=any(sig[-1] is not None for sig in signatures if len(sig) == 4))
    if len(leaves) > _LARGE:
        try:
            ref = weakref.ref(value, lambda _, key=id(value): _SIGNATURES.pop(key, None))
        except TypeError:  # not weakly referable: computed at every call
            return found
        _SIGNATURES[id(value)] = (ref, found)
    return found


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a DeviceProgram, normalized: every argument by name, defaults filled in."""

    statics: dict
    dynamic: dict
    key: tuple | None     # in-memory key: the program, its statics, the dynamic tree and leaves
    traced: bool          # no executable of its own: the jitted function's call (below)
    as_made: bool         # under an outer trace: the jitted function called as the caller called


class DeviceProgram:
    """`jax.jit(fun, **jit_options)` whose executables are kept (module docstring).

    `check(**arguments)` runs first, on the host: it raises on bad input, before anything is
    donated. `place(arguments)` may return the arguments placed on several devices (params
    split over a mesh), a call the jitted function then runs as it is; or None. `trace`,
    `lower` and `eval_shape` are the jitted function's, with the arguments bound the same way."""

    def __init__(self, fun: Callable, *, check: Callable | None = None, place: Callable | None = None,
                 **jit_options):
        functools.update_wrapper(self, fun)
        self.jitted = jax.jit(fun, **jit_options)
        self._check, self._place = check, place
        self._signature = inspect.signature(fun)
        names = list(self._signature.parameters)
        self._static = frozenset(jit_options.get("static_argnames", ())) | {
            names[i] for i in jit_options.get("static_argnums", ())}
        self._name = f"{fun.__module__}.{fun.__qualname__}"
        self._jit_text = repr(sorted((k, v) for k, v in jit_options.items()
                                     if k not in ("static_argnums", "static_argnames")))

    # -- calls ------------------------------------------------------------------------------------

    def bind(self, *args, check: bool = True, **kwargs) -> Call:
        """The call normalized (check=False: without the host check, for abstract arguments)."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if check and self._check is not None:
            self._check(**arguments)
        placed = self._place(arguments) if self._place is not None else None
        keep = placed is None
        arguments = arguments if placed is None else placed
        statics = {k: v for k, v in arguments.items() if k in self._static}
        dynamic = {k: v for k, v in arguments.items() if k not in self._static}
        signatures = tuple((name, _signature_of(value)) for name, value in dynamic.items())
        tracer = any(sig.tracer for _, sig in signatures)
        traced = not keep or tracer or any(sig.elsewhere for _, sig in signatures)
        key = None if traced else (self, tuple(statics.items()), signatures)
        return Call(statics, dynamic, key, traced, tracer and keep)

    def __call__(self, *args, **kwargs):
        call = self.bind(*args, **kwargs)
        if call.as_made:  # under the caller's trace: the caller's program is then the bare jit's
            return self.jitted(*args, **kwargs)
        if call.traced:  # by name, as `lowered` lowers it (precompile), so that JAX's cache serves both
            return self.jitted(**call.statics, **call.dynamic)
        executable = _EXECUTABLES.by_key.get(call.key)
        if executable is None:
            executable = self.build(call)
        return executable(**call.dynamic)

    def trace(self, *args, **kwargs):
        call = self.bind(*args, **kwargs)
        return self.jitted.trace(**call.statics, **call.dynamic)

    def lower(self, *args, **kwargs):
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args, **kwargs):
        call = self.bind(*args, **kwargs)
        return self.jitted.eval_shape(**call.statics, **call.dynamic)

    def compiled_count(self) -> int:
        """How many executables of this function the process holds."""
        return sum(1 for key in list(_EXECUTABLES.by_key) if key[0] is self)

    # -- building, keeping, loading ----------------------------------------------------------------

    def lowered(self, call: Call):
        return self.jitted.trace(**call.statics, **call.dynamic).lower()

    def build(self, call: Call, lowered=None):
        """The executable for `call`: one this process holds or stored, else traced, lowered
        (unless `lowered` is given), compiled and kept. One thread at a time per program: the
        others wait and take its executable (see `_Executables.building`)."""
        if call.traced:
            return self.keep(call, *compile_lowered(self.lowered(call) if lowered is None else lowered))
        with _EXECUTABLES.build_lock(call.key):
            executable = self.load(call)
            if executable is None:
                executable = self.keep(call, *compile_lowered(self.lowered(call) if lowered is None else lowered))
        return executable

    def keep(self, call: Call, executable, storable: bool = True):
        """Hold `executable` for calls like `call`, and store it where programs are stored
        (storable=False: in memory only; see `compile_lowered`)."""
        if call.traced:  # the jitted function's own cache holds it
            return executable
        with _EXECUTABLES.lock:
            _EXECUTABLES.by_key[call.key] = executable
        path = self._path(call) if storable else None
        if path is not None:
            _store(path, self._key_text(call), executable)
        return executable

    def load(self, call: Call):
        """The executable for `call` from memory or from the store, or None."""
        if call.traced:
            return None
        executable = _EXECUTABLES.by_key.get(call.key)
        if executable is not None:
            return executable
        path = self._path(call)
        if path is None or not path.exists():
            return None
        executable = _load(path, self._key_text(call))
        if executable is not None:
            with _EXECUTABLES.lock:
                _EXECUTABLES.by_key[call.key] = executable
        return executable

    def _key_text(self, call: Call) -> str | None:
        """Everything the program depends on, as text; None where a static argument has no
        stable text (its repr names an object's address), and the program is not stored."""
        statics = repr(sorted(call.statics.items()))
        if " at 0x" in statics or " object at " in statics:
            return None
        arguments = "\n".join(f"argument {name}: {sig!r}" for name, sig in call.key[2])
        return "\n".join([_platform_text(), _settings_text(), f"function {self._name}", f"jit {self._jit_text}",
                          f"statics {statics}", arguments])

    def _path(self, call: Call) -> Path | None:
        if call.traced:
            return None
        directory = current_compile_cache()
        if directory is None:
            return None
        text = self._key_text(call)
        if text is None:
            return None
        digest = hashlib.sha256(text.encode()).hexdigest()[:40]
        return directory / "programs" / f"{self._name.rsplit('.', 1)[-1]}-{digest}.bin"


# Whether the compile running in this thread was read from JAX's persistent cache. On the CPU an
# executable read back from there and serialized again loses part of itself (run in a later
# process, it fails with "Function wrapped_reduce not found"), so there only fresh compiles are
# stored; a GPU's runs as it should.
_THIS_THREAD = threading.local()
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _note_cache_hit(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
        _THIS_THREAD.cache_hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def compile_lowered(lowered) -> tuple[Any, bool]:
    """XLA's compile of a lowered program -> (executable, whether it may be stored: not on the
    CPU when it was read from JAX's persistent cache)."""
    _THIS_THREAD.cache_hit = False
    executable = lowered.compile()
    return executable, not _THIS_THREAD.cache_hit or jax.default_backend() != "cpu"


def device_program(fun: Callable | None = None, **options):
    """Decorator: `DeviceProgram(fun, **options)`, with or without options."""
    if fun is None:
        return lambda f: DeviceProgram(f, **options)
    return DeviceProgram(fun, **options)


# -- the file of one stored program ---------------------------------------------------------------
# FORMAT, the SHA-256 of the rest, then a pickle of (key text, serialized executable, input tree,
# output tree). The key text is compared whole, so a file never runs for another key.

def _store(path: Path, key_text: str, executable) -> None:
    try:
        serialized, in_tree, out_tree = serialize_executable.serialize(executable)
        body = pickle.dumps((key_text, serialized, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(FORMAT + hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except Exception as e:  # a program that cannot be stored still runs
        log.warning("could not store the program in %s: %s: %s", path, type(e).__name__, e)


def _load(path: Path, key_text: str):
    """The executable stored at `path` for `key_text`, or None (with a log line) if the file is
    not what its name promises; such a file is removed, to be written again."""
    why = None
    try:
        data = path.read_bytes()
    except OSError as e:
        log.warning("stored program %s could not be read (%s): building it again", path, e)
        return None
    head = len(FORMAT) + 32
    if len(data) < head or not data.startswith(FORMAT):
        why = "not a stored program of this version (its header differs)"
    elif hashlib.sha256(data[head:]).digest() != data[len(FORMAT):head]:
        why = f"truncated or corrupt ({len(data)} bytes, its checksum differs)"
    else:
        try:
            stored_key, serialized, in_tree, out_tree = pickle.loads(data[head:])
            if stored_key != key_text:
                why = "stored for another key"
            else:
                # Stored programs run on the default device alone (calls placed elsewhere are not
                # stored); without this a process of several devices would load them for all.
                return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                                 execution_devices=[jax.devices()[0]])
        except Exception as e:
            why = f"unreadable ({type(e).__name__}: {e})"
    log.warning("stored program %s is %s: building it again", path, why)
    try:
        path.unlink()
    except OSError:
        pass
    return None


__all__ = ["DeviceProgram", "device_program", "Call", "compile_lowered"]

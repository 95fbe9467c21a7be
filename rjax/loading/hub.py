"""GGUF files pulled from a Hugging Face repository or a plain URL into the local store, and found there again.

What a user can name:

- `org/repo:PATTERN`: the one `.gguf` file of the repository whose name holds PATTERN as a word,
  case aside (`Q4_K_M` matches `qwen2.5-0.5b-instruct-q4_k_m.gguf`; `Q4_K` does not), or
  matches it as a glob (`*Q4_K*`); `org/repo` alone: its only `.gguf` file;
- `org/repo/path/file.gguf`: that file;
- `https://host/.../file.gguf`: a plain URL.

The hub goes through `huggingface_hub` (resumable downloads, progress, HF_ENDPOINT, HF_TOKEN and
HF_HOME as it reads them); the file's sha256 from the repository's file list is checked before the
file is kept. A URL is streamed to `<file>.part` next to its final path, resumed with an HTTP Range
request when a part is there, and renamed into place only after its GGUF header parses. Either
way a stamp (`<file>.sha256`, see rjax.loading.store) records the check; a file without a current stamp
is not used.

The store: `<home>/models/hf/<org>/<repo>/<file>` and `<home>/models/url/<file>`, beside the
catalog's files in `<home>/models/`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tqdm import tqdm

from rjax.loading.store import CatalogError, file_sha256, rjax_home, stamp_path, stamp_vouches, write_stamp

HUB_DIR, URL_DIR = "hf", "url"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_PATTERN = re.compile(rf"^(?:hf\.co/)?({_NAME}/{_NAME})(?::([^/:]+))?$")
_REPO_FILE = re.compile(rf"^(?:hf\.co/)?({_NAME}/{_NAME})/((?:[^/]+/)*[^/]+\.gguf)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class HubRef:
    """A file of a Hugging Face model repository: named (`file`), or to be picked by `pattern`."""

    repo: str
    file: str | None = None
    pattern: str | None = None


@dataclasses.dataclass(frozen=True)
class UrlRef:
    url: str
    file_name: str


def parse_ref(text: str) -> HubRef | UrlRef | None:
    """What `text` names, or None when it is neither a hub reference nor a URL."""
    if text.startswith(("https://", "http://")):
        name = unquote(urlsplit(text).path.rsplit("/", 1)[-1])
        if not name.lower().endswith(".gguf") or name.startswith("."):
            raise CatalogError(f"URL {text} does not end in a .gguf file name; rjax pulls GGUF files only")
        return UrlRef(text, name)
    if m := _REPO_FILE.match(text):
        return HubRef(m.group(1), file=m.group(2))
    if m := _REPO_PATTERN.match(text):
        return HubRef(m.group(1), pattern=m.group(2))
    return None


def store_dir(ref: HubRef | UrlRef, home=None) -> Path:
    models = rjax_home(home) / "models"
    return models / URL_DIR if isinstance(ref, UrlRef) else models / HUB_DIR / ref.repo


def matching(files: list[str], ref: HubRef) -> list[str]:
    """The `.gguf` files of `files` that `ref` names (several or none: the caller says which are there)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if ref.file is not None:
        return [f for f in ggufs if f == ref.file]
    if ref.pattern is None:
        return ggufs
    if any(c in ref.pattern for c in "*?["):
        return [f for f in ggufs if fnmatch.fnmatch(f.lower(), ref.pattern.lower())]
    word = re.compile(rf"(?<![a-z0-9]){re.escape(ref.pattern.lower())}(?![a-z0-9_])")
    return [f for f in ggufs if word.search(Path(f).name.lower()[:-len(".gguf")])]


def _choose(files: list[str], ref: HubRef, where: str, hint: str) -> str:
    found = matching(files, ref)
    if len(found) == 1:
        return found[0]
    matching_what = f" matching {ref.pattern!r}" if ref.pattern else ""
    if not found:
        problem = f"no file {ref.file}" if ref.file else f"no .gguf file{matching_what}"
    else:
        problem = f"{len(found)} .gguf files{matching_what}; name one as {ref.repo}:QUANT or {ref.repo}/FILE"
    ggufs = [f for f in files if f.lower().endswith(".gguf")] or ["(none)"]
    raise CatalogError(f"{where} has {problem}. {hint}: {', '.join(ggufs)}")


def _is_stamped(path: Path) -> bool:
    """The file is there and was checked when it was pulled (its stamp has the file's mtime)."""
    try:
        return stamp_path(path).stat().st_mtime_ns == path.stat().st_mtime_ns
    except OSError:
        return False


def _check_gguf(path: Path, source: str) -> None:
    from rjax.loading.loaders.errors import ModelFileError
    from rjax.loading.loaders.gguf_header import config_from_reader, open_gguf

    try:
        config_from_reader(open_gguf(path, string_arrays=False), path)
    except ModelFileError as e:
        raise CatalogError(f"the file downloaded from {source} is not a usable GGUF model: {e}") from e


# ---------------------------------------------------------------------------------------------
# pulling


def pull(ref: HubRef | UrlRef, home=None, progress: bool = True) -> Path:
    """Download what `ref` names into the store, check it, and return its path there."""
    return pull_url(ref, home, progress) if isinstance(ref, UrlRef) else pull_hub(ref, home, progress)


def pull_hub(ref: HubRef, home=None, progress: bool = True, *, endpoint: str | None = None) -> Path:
    """`endpoint`: the hub's URL (default huggingface_hub's: $HF_ENDPOINT, else huggingface.co)."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError

    where = f"{endpoint or constants.ENDPOINT}/{ref.repo}"
    try:
        siblings = HfApi(endpoint=endpoint).model_info(ref.repo, files_metadata=True).siblings or []
    except RepositoryNotFoundError as e:
        raise CatalogError(f"cannot pull {ref.repo}: no such model repository at {where} (or it is private or "
                           f"gated: set HF_TOKEN)") from e
    except _network_errors() as e:
        raise CatalogError(f"cannot pull {ref.repo}: {where} could not be read: {e}") from e
    by_name = {s.rfilename: s for s in siblings}
    file = _choose(list(by_name), ref, where, "Its .gguf files")
    lfs = by_name[file].lfs
    sha256 = lfs.sha256 if lfs is not None else None
    local_dir = store_dir(ref, home)
    dest = local_dir / file
    if stamp_vouches(dest, sha256) if sha256 else _is_stamped(dest):
        return dest
    stamp_path(dest).unlink(missing_ok=True)
    try:
        got = Path(hf_hub_download(ref.repo, file, local_dir=local_dir, endpoint=endpoint,
                                   tqdm_class=_bar(progress)))
    except _network_errors() as e:
        raise CatalogError(f"cannot pull {ref.repo}/{file} from {where}: {e} (run the same pull again to "
                           f"resume)") from e
    try:
        if sha256 is not None:
            digest = file_sha256(got, progress=progress, desc=f"verify {got.name}")
            if digest != sha256:
                raise CatalogError(f"checksum mismatch for {ref.repo}/{file}: the hub lists sha256 {sha256}, "
                                   f"the download has {digest}; it was removed")
        _check_gguf(got, f"{where}/{file}")
    except BaseException:
        got.unlink(missing_ok=True)
        raise
    write_stamp(got, sha256 or file_sha256(got))
    return got


def pull_url(ref: UrlRef, home=None, progress: bool = True) -> Path:
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get

    dest = store_dir(ref, home) / ref.file_name
    if _is_stamped(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with open(part, "ab") as out:
            resume = out.tell()
            try:  # resumes with a Range request; a server that ignores it sends the whole file again
                http_get(ref.url, out, resume_size=resume, displayed_filename=ref.file_name,
                         tqdm_class=_bar(progress))
            except HfHubHTTPError as e:
                if e.response is None or e.response.status_code != 416 or not resume:
                    raise CatalogError(f"cannot pull {ref.url}: {e}") from e
                # 416: nothing is left past the part's end, so the part is the whole file (checked below)
            except _network_errors() as e:
                raise CatalogError(f"cannot pull {ref.url}: {e}") from e
    except BaseException as e:
        if part.stat().st_size == 0:
            part.unlink()
        elif isinstance(e, CatalogError):
            raise CatalogError(f"{e} ({part.stat().st_size:,} bytes are kept in {part}: run the same pull again "
                               f"to resume)") from e.__cause__
        raise
    try:
        _check_gguf(part, ref.url)
    except CatalogError:
        part.unlink()
        raise
    sha256 = file_sha256(part, progress=progress, desc=f"sha256 {ref.file_name}")
    os.replace(part, dest)
    write_stamp(dest, sha256)
    return dest


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a failed request raises: the hub's HTTP errors, OS errors, and the errors of the HTTP
    client huggingface_hub uses (httpx, or httpx2 in its newer versions)."""
    from huggingface_hub.errors import HfHubHTTPError

    clients = (sys.modules[m].HTTPError for m in ("httpx2", "httpx") if hasattr(sys.modules.get(m), "HTTPError"))
    return (HfHubHTTPError, OSError, *clients)


def _bar(progress: bool):
    """huggingface_hub's own bar, or a silent one."""
    return None if progress else functools.partial(tqdm, disable=True)


# ---------------------------------------------------------------------------------------------
# finding pulled files


def find_local(text: str, home=None) -> Path | None:
    """The pulled file that `text` names (`org/repo:PATTERN`, `org/repo/file.gguf`, a URL, or a
    pulled file's name), without the network; None when `text` is none of these forms. A form
    that names nothing pulled is a CatalogError that says how to pull it."""
    ref = parse_ref(text)
    if ref is None:
        if text.lower().endswith(".gguf") and "/" not in text and os.sep not in text:
            found = [p for p in pulled_files(home) if p.name == text]
            if len(found) > 1:
                raise CatalogError(f"{text} was pulled from several places: {', '.join(map(str, found))}; "
                                   f"name one by its path")
            return found[0] if found else None
        return None
    root = store_dir(ref, home)
    if isinstance(ref, UrlRef):
        path = root / ref.file_name
        if _is_stamped(path):
            return path
        raise CatalogError(f"{ref.url} is not pulled (expected at {path}); run `rjax pull {ref.url}`")
    here = [p.relative_to(root).as_posix() for p in _ggufs(root)]
    if not here:
        raise CatalogError(f"{text} is no local path, and nothing is pulled from the repository {ref.repo} "
                           f"(looked in {root}); run `rjax pull {text}`")
    return root / _choose(here, ref, f"the pulled copy of {ref.repo} ({root})", "Pulled")


def _ggufs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.gguf") if ".cache" not in p.relative_to(root).parts and _is_stamped(p))


def pulled_files(home=None) -> list[Path]:
    """Every checked file of the store (hub and URL pulls; the catalog's files are listed by rjax.loading.catalog)."""
    models = rjax_home(home) / "models"
    return _ggufs(models / HUB_DIR) + _ggufs(models / URL_DIR)


def pulled_name(path: Path, home=None) -> str:
    """What names a pulled file on the command line: `org/repo/file.gguf`, or the file name for a URL pull."""
    models = rjax_home(home) / "models"
    rel = path.relative_to(models).parts
    return "/".join(rel[1:]) if rel[0] == HUB_DIR else path.name

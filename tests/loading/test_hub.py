"""`rjax pull` from a Hugging Face repository and from a URL, `rjax list`, and finding pulled files
again offline. A loopback HTTP server stands in for the hub (the model-info API and
`resolve/<revision>/<file>` with ETag, X-Repo-Commit, Content-Length and Range) and for a plain
file server; the payload is a tiny synthetic GGUF. Nothing here reaches the network."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rjax.loading import catalog, hub
from rjax.loading.catalog import CatalogError
from rjax.loading.hub import HubRef, UrlRef

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    from rjax.loading.synth import write_synthetic

    path = tmp_path_factory.mktemp("hub") / "one.gguf"
    return write_synthetic(path, "smollm2-135m", "q8_0", seed=5, n_layers=1, vocab_size=320,
                           tokenizer_from="builtin").read_bytes()


class Server:
    """Repositories {repo: {file: bytes}} under the hub's paths, plain files under /files/; every
    request's method, path and Range header is kept in `requests`."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.listed_sha: dict[tuple[str, str], str] = {}  # a wrong sha256 the file list gives instead
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.authorized: list[str] = []  # paths of the requests that carried a token
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body: bool):
                server.requests.append((self.command, self.path, self.headers.get("Range")))
                if self.headers.get("Authorization") == "Bearer hf_test_token":
                    server.authorized.append(self.path)
                path = self.path.split("?")[0]
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
                    return self.api(m.group(1))
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path):
                    data = server.repos.get(m.group(1), {}).get(m.group(2))
                    return self.send_file(data, body, hashlib.sha256(data).hexdigest() if data else None)
                if m := re.fullmatch(r"/files/(.+)", path):
                    return self.send_file(server.files.get(m.group(1)), body, None)
                self.send_error(404)

            def api(self, repo):
                files = server.repos.get(repo)
                if files is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.end_headers()
                    return
                siblings = [dict(rfilename=name, size=len(data), blobId="0" * 40,
                                 lfs=dict(sha256=server.listed_sha.get((repo, name),
                                                                       hashlib.sha256(data).hexdigest()),
                                          size=len(data), pointerSize=130))
                            for name, data in files.items()]
                out = json.dumps(dict(id=repo, sha=COMMIT, siblings=siblings)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def send_file(self, data, body, sha):
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                if (rng := self.headers.get("Range")) and (m := re.fullmatch(r"bytes=(\d+)-", rng)):
                    start = int(m.group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                if sha:
                    self.send_header("ETag", f'"{sha}"')
                    self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if body:
                    self.wfile.write(data[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def offline_env(monkeypatch, tmp_path):
    """No proxy, token or user setting of the host reaches these pulls."""
    for key in list(os.environ):
        if key.lower().endswith("_proxy") or key.startswith(("HF_", "HUGGINGFACE_")) or key == "RJAX_HOME":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def _store_files(home: Path) -> list[str]:
    """Everything left under the store, bookkeeping of huggingface_hub's resumable downloads aside."""
    root = home / "models"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and ".cache" not in p.parts) if root.exists() else []


def test_parse_ref_forms():
    assert hub.parse_ref("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M") == HubRef("Qwen/Qwen2.5-0.5B-Instruct-GGUF",
                                                                           pattern="Q4_K_M")
    assert hub.parse_ref("org/repo") == HubRef("org/repo")
    assert hub.parse_ref("hf.co/org/repo:q8_0") == HubRef("org/repo", pattern="q8_0")
    assert hub.parse_ref("org/repo/sub/model-Q8_0.gguf") == HubRef("org/repo", file="sub/model-Q8_0.gguf")
    assert hub.parse_ref("https://h.example/a/b%20c.gguf?download=1") == UrlRef(
        "https://h.example/a/b%20c.gguf?download=1", "b c.gguf")
    assert hub.parse_ref("smollm2-135m-instruct") is None and hub.parse_ref("model.gguf") is None
    with pytest.raises(CatalogError, match="does not end in a .gguf"):
        hub.parse_ref("https://h.example/model.bin")


def test_quant_pattern_matches_the_word_only():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "sub/m-q4_k.gguf"]
    assert hub.matching(files, HubRef("o/r", pattern="Q4_K_M")) == ["m-Q4_K_M.gguf"]
    assert hub.matching(files, HubRef("o/r", pattern="q4_k")) == ["sub/m-q4_k.gguf"]
    assert hub.matching(files, HubRef("o/r", pattern="*Q4_K_*")) == ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf"]
    assert hub.matching(files, HubRef("o/r", file="m-Q8_0.gguf")) == ["m-Q8_0.gguf"]
    assert hub.matching(files, HubRef("o/r")) == [f for f in files if f.endswith(".gguf")]


def test_pull_from_the_hub_then_use_it_offline(server, gguf_bytes, tmp_path):
    """org/repo:QUANT through the command, with HF_ENDPOINT naming the stand-in hub; then the
    pulled file is found by that name, by org/repo/file and by its file name with the server gone."""
    other = gguf_bytes[:-64] + bytes(64)  # a second, different file in the repository
    server.repos["org/tiny-GGUF"] = {"tiny-Q8_0.gguf": gguf_bytes, "tiny-Q4_K_M.gguf": other,
                                     "README.md": b"# tiny"}
    home = tmp_path / "home"
    env = dict(os.environ, HF_ENDPOINT=server.url, HF_TOKEN="hf_test_token", RJAX_HOME=str(home),
               PYTHONPATH=str(REPO_ROOT), NO_PROXY="127.0.0.1")
    run = subprocess.run([sys.executable, "-m", "rjax.cli", "pull", "org/tiny-GGUF:Q8_0"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    dest = home / "models" / "hf" / "org" / "tiny-GGUF" / "tiny-Q8_0.gguf"
    assert run.stdout.strip() == str(dest) and dest.read_bytes() == gguf_bytes
    assert catalog.stamp_path(dest).read_text().split()[0] == hashlib.sha256(gguf_bytes).hexdigest()
    assert _store_files(home) == ["hf/org/tiny-GGUF/tiny-Q8_0.gguf", "hf/org/tiny-GGUF/tiny-Q8_0.gguf.sha256"]
    assert any(m == "GET" and "/resolve/main/tiny-Q8_0.gguf" in p for m, p, _ in server.requests)
    # HF_TOKEN went with the file list and the downloads
    assert server.authorized == [p for _, p, _ in server.requests if "/api/models/" in p or "/resolve/" in p]

    listed = subprocess.run([sys.executable, "-m", "rjax.cli", "list", "--json"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == [dict(name="org/tiny-GGUF/tiny-Q8_0.gguf", path=str(dest),
                                              size=len(gguf_bytes), architecture="llama", quant="Q8_0",
                                              error=None)]
    server.close()  # from here on, no network
    for name in ("org/tiny-GGUF:Q8_0", "org/tiny-GGUF:q8_0", "org/tiny-GGUF/tiny-Q8_0.gguf", "tiny-Q8_0.gguf",
                 "org/tiny-GGUF"):
        assert catalog.resolve_model(name, home) == dest, name
    with pytest.raises(CatalogError, match=r"no \.gguf file matching 'Q4_K_M'.*Pulled: tiny-Q8_0.gguf"):
        catalog.resolve_model("org/tiny-GGUF:Q4_K_M", home)
    with pytest.raises(CatalogError, match=r"nothing is pulled from the repository org/other.*pull org/other:Q8_0"):
        catalog.resolve_model("org/other:Q8_0", home)


def test_pull_a_named_file_and_again_without_download(server, gguf_bytes, tmp_path):
    server.repos["org/r"] = {"sub/a.gguf": gguf_bytes}
    dest = hub.pull_hub(HubRef("org/r", file="sub/a.gguf"), tmp_path, progress=False, endpoint=server.url)
    assert dest == tmp_path / "models/hf/org/r/sub/a.gguf" and dest.read_bytes() == gguf_bytes
    gets = sum(m == "GET" and "resolve" in p for m, p, _ in server.requests)
    assert hub.pull_hub(HubRef("org/r", pattern=None), tmp_path, progress=False, endpoint=server.url) == dest
    assert sum(m == "GET" and "resolve" in p for m, p, _ in server.requests) == gets  # nothing fetched again


@pytest.mark.parametrize("ref, message", [
    (HubRef("org/two"), r"has 2 \.gguf files; name one as org/two:QUANT.*: x-Q4_0\.gguf, x-Q8_0\.gguf"),
    (HubRef("org/two", pattern="Q5_K_M"), r"no \.gguf file matching 'Q5_K_M'.*x-Q4_0\.gguf, x-Q8_0\.gguf"),
    (HubRef("org/two", file="x-F16.gguf"), r"no file x-F16\.gguf.*x-Q4_0\.gguf, x-Q8_0\.gguf"),
    (HubRef("org/none"), r"no such model repository"),
])
def test_hub_errors_list_what_is_there(server, gguf_bytes, tmp_path, ref, message):
    server.repos["org/two"] = {"x-Q4_0.gguf": gguf_bytes, "x-Q8_0.gguf": gguf_bytes}
    with pytest.raises(CatalogError, match=message):
        hub.pull_hub(ref, tmp_path, progress=False, endpoint=server.url)
    assert _store_files(tmp_path) == []


def test_hub_checksum_mismatch_leaves_nothing(server, gguf_bytes, tmp_path):
    server.repos["org/r"] = {"a.gguf": gguf_bytes}
    server.listed_sha[("org/r", "a.gguf")] = "0" * 64
    with pytest.raises(CatalogError, match=r"checksum mismatch for org/r/a\.gguf.*0{64}"):
        hub.pull_hub(HubRef("org/r"), tmp_path, progress=False, endpoint=server.url)
    assert _store_files(tmp_path) == []


def test_url_pull_resumes_a_partial_download(server, gguf_bytes, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # a hub token is not sent to other hosts
    server.files["m/tiny.gguf"] = gguf_bytes
    url = f"{server.url}/files/m/tiny.gguf"
    part = tmp_path / "models/url/tiny.gguf.part"
    part.parent.mkdir(parents=True)
    half = len(gguf_bytes) // 2
    part.write_bytes(gguf_bytes[:half])  # what an interrupted pull left
    dest = catalog.pull(url, tmp_path, progress=False)
    assert dest == tmp_path / "models/url/tiny.gguf" and dest.read_bytes() == gguf_bytes
    assert server.requests == [("GET", "/files/m/tiny.gguf", f"bytes={half}-")] and server.authorized == []
    assert _store_files(tmp_path) == ["url/tiny.gguf", "url/tiny.gguf.sha256"]
    assert catalog.resolve_model(url, tmp_path) == catalog.resolve_model("tiny.gguf", tmp_path) == dest
    assert catalog.pull(url, tmp_path, progress=False) == dest and len(server.requests) == 1  # no second download


def test_url_pull_of_a_complete_part_and_of_a_corrupt_file(server, gguf_bytes, tmp_path):
    server.files["ok.gguf"] = gguf_bytes
    part = tmp_path / "models/url/ok.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(gguf_bytes)  # interrupted after the last byte, before the check
    assert catalog.pull(f"{server.url}/files/ok.gguf", tmp_path, progress=False).read_bytes() == gguf_bytes

    server.files["bad.gguf"] = gguf_bytes[: len(gguf_bytes) // 3]  # a truncated file: its tensors run past the end
    with pytest.raises(CatalogError, match=r"bad\.gguf is not a usable GGUF model: .*truncated or corrupt"):
        catalog.pull(f"{server.url}/files/bad.gguf", tmp_path, progress=False)
    server.files["html.gguf"] = b"<html>not found</html>"
    with pytest.raises(CatalogError, match=r"html\.gguf is not a usable GGUF model: .*not a GGUF file"):
        catalog.pull(f"{server.url}/files/html.gguf", tmp_path, progress=False)
    with pytest.raises(CatalogError, match=r"cannot pull .*missing\.gguf.*404"):
        catalog.pull(f"{server.url}/files/missing.gguf", tmp_path, progress=False)
    assert _store_files(tmp_path) == ["url/ok.gguf", "url/ok.gguf.sha256"]

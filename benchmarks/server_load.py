"""A bounded load test of an OpenAI-compatible server: `rjax serve`, or llama.cpp's `llama-server`
on the same GGUF file, driven by the same load generator over loopback.

    python benchmarks/server_load.py -m MODEL.gguf --out "$OUT/server_load.json"                 # rjax
    python benchmarks/server_load.py -m MODEL.gguf --llama-server build/bin/llama-server --out ...  # both
    python benchmarks/server_load.py -m smollm2-135m-instruct --soak 1000 --out /tmp/soak.json      # CPU soak

After a warm-up of two requests and the server's background compiles (rjax serve is healthy
once a first request's programs are built), for each concurrency level (1, 8, 32, 64):
--requests streaming completions (each a random prompt of --prompt tokens, given as token ids so
both servers see the same input, and --gen new tokens with ignore_eos) issued by that many
client tasks, within a --time-limit per level. Reported:
output tokens/s over the level's wall time, and p50 / p99 time to first token. With
--llama-server, the same levels run against llama-server and the table gives rjax's ratio
(target: output tokens/s >= 1.5x at concurrency 32; p50 TTFT no worse at concurrency 1).

--soak N: N requests at concurrency 8 against rjax alone, in rounds of 100; the server process's
RSS after each round, once it is idle (host memory should stay flat). With --mix, the requests
vary as a server's do: short and long prompts, streaming and not, greedy and seeded sampling,
log-probabilities, and clients that leave after the first chunk. rss_growth is measured from the
first round past warm-up (200 requests) to the last.

    python benchmarks/server_load.py -m smollm2-135m-instruct --soak 5000 --mix --max-len 2048 --out /tmp/mix.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def say(msg: str) -> None:
    print(f"[server_load {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{cmd[0]} was not healthy within {timeout:.0f} s")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], gen: int) -> tuple:
    """-> (time to first token s, output tokens) of one streaming completion."""
    body = dict(model=model, prompt=prompt, max_tokens=gen, temperature=0, stream=True, ignore_eos=True,
                stream_options={"include_usage": True})
    t0 = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices") and data["choices"][0].get("text") is not None:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - t0, tokens if tokens is not None else chunks


async def mixed_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], gen: int,
                        rng: np.random.Generator) -> tuple:
    """One request of the --mix soak: -> (seconds, output tokens; 0 for a client that left)."""
    long = rng.random() < 0.25
    body = dict(model=model, prompt=prompt if long else prompt[:16], max_tokens=int(rng.integers(1, gen + 1)),
                ignore_eos=True, stream=bool(rng.random() < 0.5))
    if rng.random() < 0.5:
        body.update(temperature=0.8, top_p=0.95, seed=int(rng.integers(0, 2 ** 31)))
    else:
        body.update(temperature=0)
    if rng.random() < 0.3:
        body.update(logprobs=int(rng.integers(0, 6)))
    leave = body["stream"] and rng.random() < 0.2
    t0 = time.perf_counter()
    if not body["stream"]:
        r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if leave and line.startswith("data: "):
                return time.perf_counter() - t0, 0  # the client goes away mid-stream
    return time.perf_counter() - t0, body["max_tokens"]


async def level(url: str, model: str, prompts: list[list[int]], gen: int, concurrency: int, time_limit: float,
                mix: np.random.Generator | None = None) -> dict:
    queue = list(prompts)
    results, t0 = [], time.perf_counter()

    async def worker(client):
        while queue and time.perf_counter() - t0 < time_limit:
            if mix is not None:
                results.append(await mixed_request(client, url, model, queue.pop(), gen, mix))
            else:
                results.append(await one_request(client, url, model, queue.pop(), gen))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttft = [r[0] for r in results]
    return dict(concurrency=concurrency, requests=len(results), wall_s=wall,
                output_tokens_per_s=sum(r[1] for r in results) / wall,
                ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)))


def wait_for_compiles(url: str, timeout: float) -> None:
    """Until the server's /health lists no program still compiling in the background (rjax serve
    builds what a first request needs before it is healthy, the rest while serving): the levels
    measure the steady state, not the start-up."""
    t0 = time.perf_counter()
    while httpx.get(f"{url}/health", timeout=10).json().get("compiling"):
        if time.perf_counter() - t0 > timeout:
            say(f"programs still compiling after {timeout:.0f} s; measuring anyway")
            return
        time.sleep(1.0)
    if time.perf_counter() - t0 > 1.0:
        say(f"background compiles done {time.perf_counter() - t0:.0f} s after the warm-up")


def run_server(name: str, cmd: list[str], url: str, a, prompts) -> dict:
    say(f"starting {name}")
    proc = start(cmd, url, a.start_timeout)
    try:
        out = {}
        asyncio.run(level(url, "m", prompts[0][:2], 4, 2, a.time_limit))
        wait_for_compiles(url, a.start_timeout)
        for c, level_prompts in zip(a.concurrency, prompts[1:]):
            out[str(c)] = r = asyncio.run(level(url, "m", level_prompts, a.gen, c, a.time_limit))
            say(f"{name} c={c}: {r['output_tokens_per_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms "
                f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms ({r['requests']} requests)")
        return out
    finally:
        stop(proc)


def soak(cmd, url, a, prompts) -> dict:
    """a.soak requests at concurrency 8 in rounds of 100; after each round, once the server is
    idle (it returns freed heap to the OS then), its RSS. Sampled mid-round, RSS would also
    count whatever the requests in flight hold at that moment (on the CPU, the device buffers
    of the step running)."""
    proc = start(cmd, url, a.start_timeout)
    samples, done, t0 = [], 0, time.perf_counter()
    pool = [p for level_prompts in prompts for p in level_prompts]
    mix = np.random.default_rng(1) if a.mix else None
    try:
        while done < a.soak:
            n = min(100, a.soak - done)
            asyncio.run(level(url, "m", [pool[(done + i) % len(pool)] for i in range(n)], a.gen, 8, float("inf"),
                              mix))
            done += n
            time.sleep(1.0)
            samples.append((done, rss_bytes(proc.pid)))
            say(f"soak {done}: rss {samples[-1][1] / 2**20:.1f} MiB")
    finally:
        stop(proc)
    after = [v for n, v in samples if n >= 200] or [v for _, v in samples]
    return dict(requests=done, wall_s=time.perf_counter() - t0, rss_samples_mib={n: v / 2**20 for n, v in samples},
                rss_growth=(after[-1] - after[0]) / after[0] if after else None,
                rss_range=(max(after) - min(after)) / min(after) if after else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", required=True, help="a .gguf file (or, for rjax alone, a catalog name)")
    p.add_argument("--out", required=True)
    p.add_argument("--llama-server", default=None, help="llama-server binary: run the same levels against it")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=128, help="requests per level")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per level")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--soak", type=int, default=0, help="run N requests at concurrency 8 and sample the server's RSS")
    p.add_argument("--mix", action="store_true", help="with --soak: vary the requests (lengths, streaming, sampling, "
                                                     "logprobs, clients leaving)")
    p.add_argument("--token-range", default="1000,30000", help="prompt token ids are drawn from [LO, HI)")
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    rng = np.random.default_rng(0)
    lo, hi = (int(v) for v in a.token_range.split(","))   # default: away from a vocabulary's special tokens
    # Disjoint prompt sets (warm-up, then one per level), the same for both servers: no level reuses
    # a prompt another has sent, so neither server's prompt cache serves a repeat.
    prompts = [[[int(t) for t in rng.integers(lo, hi, a.prompt)] for _ in range(a.requests)]
               for _ in range(len(a.concurrency) + 1)]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    rjax_cmd = [sys.executable, "-m", "rjax.cli", "serve", "-m", a.model, "--port", str(port), "--slots",
                str(a.slots), "--max-len", str(a.max_len), "--served-model-name", "m"]
    result: dict = dict(args=vars(a))
    if a.soak:
        result["soak"] = soak(rjax_cmd, url, a, prompts)
    else:
        result["rjax"] = run_server("rjax", rjax_cmd, url, a, prompts)
        if a.llama_server:
            port2 = _free_port()
            cmd = [a.llama_server, "-m", a.model, "--port", str(port2), "-np", str(a.slots), "-c",
                   str(a.slots * a.max_len), "-ngl", "999", "--cont-batching", "-a", "m"]
            result["llama_server"] = run_server("llama-server", cmd, f"http://127.0.0.1:{port2}", a, prompts)
            result["ratios"] = {c: dict(
                tokens_per_s=result["rjax"][c]["output_tokens_per_s"] / result["llama_server"][c]["output_tokens_per_s"],
                ttft_p50=result["rjax"][c]["ttft_p50_s"] / result["llama_server"][c]["ttft_p50_s"])
                for c in result["rjax"]}
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

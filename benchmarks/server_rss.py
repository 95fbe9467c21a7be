"""Host memory of `rjax serve` under a long mixed load: does its RSS stay flat after warm-up?

    python benchmarks/server_rss.py                                   # the default model, 5,000 requests
    python benchmarks/server_rss.py -m MODEL -n 500 --every 50 --out /tmp/rss.json
    python benchmarks/server_rss.py -n 500 --serve-arg=--no-precompile    # compile as requests need

Starts `rjax serve` as a subprocess, sends --warmup requests, then N mixed requests with
--concurrency in flight: short and long prompts, /v1/completions and /v1/chat/completions,
streaming and not, greedy and seeded sampling, log-probabilities, clients that leave after the
first chunk, and JSON-schema constrained chats. The warm-up ends when the background compiles
have finished too (compiled programs are part of the steady state). Every --every requests, once the server is idle
(it returns freed heap to the OS then; sampled mid-round RSS would also count the buffers of the
step in flight), it reads the server's VmRSS from /proc/PID/status. Prints the series as a table
and as JSON, and the verdict: whether every sample is within --tolerance (10%) of the first one
after warm-up.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import _free_port, rss_bytes, start, stop, wait_for_compiles  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under bright northern lights near the old harbour").split()


def say(msg: str) -> None:
    print(f"[server_rss {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_request(rng: np.random.Generator, gen: int, long_words: int) -> tuple[str, dict, bool]:
    """One request of the mix: -> (route, body, whether the client leaves after the first chunk)."""
    n_words = long_words if rng.random() < 0.25 else int(rng.integers(2, 12))
    text = " ".join(rng.choice(WORDS, n_words))
    body = dict(model="m", max_tokens=int(rng.integers(1, gen + 1)), stream=bool(rng.random() < 0.5))
    if rng.random() < 0.5:
        body.update(temperature=0.8, top_p=0.95, seed=int(rng.integers(0, 2 ** 31)))
    else:
        body.update(temperature=0)
    if rng.random() < 0.1:  # JSON-schema constrained: a chat that answers with an object
        body.update(messages=[{"role": "user", "content": f"A person named after: {text}"}], max_tokens=48,
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        return "/v1/chat/completions", body, False
    leave = body["stream"] and rng.random() < 0.2
    if rng.random() < 0.3:
        body.update(messages=[{"role": "user", "content": text}])
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=int(rng.integers(0, 6)))
        return "/v1/chat/completions", body, leave
    body.update(prompt=text, ignore_eos=True)
    if rng.random() < 0.3:
        body.update(logprobs=int(rng.integers(0, 6)))
    return "/v1/completions", body, leave


async def send(client: httpx.AsyncClient, url: str, route: str, body: dict, leave: bool) -> str:
    """-> "ok", "left" (the client went away mid-stream) or the error status."""
    if not body["stream"]:
        r = await client.post(url + route, json=body, timeout=600)
        return "ok" if r.status_code == 200 else f"http {r.status_code}"
    async with client.stream("POST", url + route, json=body, timeout=600) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"error"' in line[:16]:
                return "stream error"
            if leave and line.startswith("data: "):
                return "left"
    return "ok"


async def round_(url: str, requests: list, concurrency: int) -> list[str]:
    queue, outcomes = list(requests), []

    async def worker(client):
        while queue:
            outcomes.append(await send(client, url, *queue.pop()))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return outcomes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=None, help="a model rjax serve takes (default: its default model)")
    p.add_argument("-n", "--requests", type=int, default=5000, help="mixed requests after warm-up (default 5000)")
    p.add_argument("--warmup", type=int, default=200, help="requests before the reference sample (default 200)")
    p.add_argument("--every", type=int, default=250, help="sample RSS every this many requests (default 250)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gen", type=int, default=32, help="max_tokens of a request at most")
    p.add_argument("--long-words", type=int, default=300, help="words of a long prompt")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--serve-arg", action="append", default=[], help="one more argument for rjax serve (repeatable)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rjax.cli", "serve", "--port", str(port), "--slots", str(a.slots), "--max-len",
           str(a.max_len), "--served-model-name", "m"] + (["-m", a.model] if a.model else []) + a.serve_arg
    rng = np.random.default_rng(0)
    say(f"starting {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    proc = start(cmd, url, a.start_timeout)
    say(f"healthy after {time.perf_counter() - t0:.0f} s, RSS {rss_bytes(proc.pid) / 2**20:.0f} MiB")
    series, outcomes, done, interrupted = [], {}, 0, False
    try:
        while done < a.warmup + a.requests:
            n = min(a.every, a.warmup + a.requests - done) if done >= a.warmup else a.warmup - done
            batch = [make_request(rng, a.gen, a.long_words) for _ in range(n)]
            for o in asyncio.run(round_(url, batch, a.concurrency)):
                outcomes[o] = outcomes.get(o, 0) + 1
            done += n
            time.sleep(1.0)
            if done == a.warmup:  # programs still compiling in the background belong to the warm-up
                wait_for_compiles(url, a.start_timeout)
            health = httpx.get(f"{url}/health", timeout=10).json()
            series.append(dict(requests=done, rss_mib=round(rss_bytes(proc.pid) / 2**20, 1),
                               compiling=len(health.get("compiling", [])), s=round(time.perf_counter() - t0)))
            say(f"{done} requests: RSS {series[-1]['rss_mib']} MiB ({series[-1]['compiling']} programs compiling)")
    except KeyboardInterrupt:  # report the series so far
        interrupted = True
    finally:
        stop(proc)
    if not series:
        return 1
    base = series[0]["rss_mib"]
    worst = max(abs(s["rss_mib"] - base) / base for s in series)
    verdict = (f"{'within' if worst <= a.tolerance else 'NOT within'} {a.tolerance:.0%} of the post-warm-up level "
               f"({base} MiB; largest departure {worst:.1%})")
    print(f"\n{'requests':>9} {'RSS MiB':>9} {'vs warm':>8} {'compiling':>9}")
    for s in series:
        print(f"{s['requests']:>9} {s['rss_mib']:>9.1f} {(s['rss_mib'] - base) / base:>+8.1%} {s['compiling']:>9}")
    result = dict(args=vars(a), outcomes=outcomes, series=series, post_warmup_mib=base, largest_departure=worst,
                  verdict=verdict, interrupted_after=done if interrupted else None)
    print(json.dumps(result))
    print(verdict)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

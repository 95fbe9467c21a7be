"""The server's Prometheus metrics, in a registry of their own (one per server, no process globals)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few ms (a decode step on a GPU) to a minute (a long queue wait).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("rjax_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.requests_finished = Counter("rjax_requests_finished", "Generated sequences by finish reason",
                                         ["finish_reason"], registry=r)
        self.running = Gauge("rjax_requests_running", "Sequences holding a slot", registry=r)
        self.queued = Gauge("rjax_requests_queued", "Sequences waiting for a slot", registry=r)
        self.prompt_tokens = Counter("rjax_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("rjax_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("rjax_time_to_first_token_seconds", "From a sequence's submission to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("rjax_inter_token_latency_seconds",
                             "Between a sequence's tokens (a dispatch's time shared by the tokens it made)",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_pages_in_use = Gauge("rjax_kv_pages_in_use", "KV-cache pages held by sequences", registry=r)
        self.kv_pages_total = Gauge("rjax_kv_pages_total", "KV-cache pages in the pool", registry=r)
        self.speculative_drafted = Counter("rjax_speculative_drafted_tokens", "Draft tokens proposed (speculative "
                                           "decoding), of finished sequences", registry=r)
        self.speculative_accepted = Counter("rjax_speculative_accepted_tokens", "Draft tokens accepted (speculative "
                                            "decoding), of finished sequences", registry=r)
        self.programs_compiling = Gauge("rjax_programs_compiling", "Programs still compiling in the background "
                                        "(a request that needs one waits for it or runs in a larger one)", registry=r)
        self.failed_steps = Counter("rjax_failed_steps", "Engine steps whose device program (or the whole step) "
                                    "failed: their requests failed, the server went on", registry=r)
        self.free_slots = Gauge("rjax_free_slots", "Slots free for a new sequence", registry=r)
        self.kv_pages_cached = Gauge("rjax_kv_pages_cached", "KV-cache pages kept for the prefix cache, held by "
                                     "no sequence", registry=r)
        self.prefix = {name: Counter(f"rjax_prefix_cache_{name}", doc, registry=r) for name, doc in (
            ("lookups", "Prompts matched against the prefix cache"),
            ("hits", "Prompts that shared at least one cached page"),
            ("pages_reused", "KV pages shared instead of computed"),
            ("tokens_saved", "Prompt tokens not prefilled thanks to the prefix cache"),
            ("evictions", "Cached pages given to a new use"))}
        self._prefix_seen: dict[str, int] = {}

    def count_prefix(self, stats) -> None:
        """Advance the prefix-cache counters to an engine's running totals (a fresh engine
        starts its totals from zero again)."""
        for name, counter in self.prefix.items():
            value = getattr(stats, name)
            seen = self._prefix_seen.get(name, 0)
            counter.inc(value - seen if value >= seen else value)
            self._prefix_seen[name] = value

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""The compiled programs of a serving engine's runner: every program a step may call, compiled
ahead (`precompile`), or the first ones now and the rest in the background (`precompile_first`);
and, while the background still compiles, which built program runs a step's call instead of
waiting for its own (a larger prompt or batch bucket, a sampled program for greedy rows, the
log-probability variant), or the wait, each logged.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from rjax.engine import steps
from rjax.engine.precompile import (BackgroundCompile, Program, compile_programs, decode_dispatch_program,
                                    prefill_into_slots_program)
from rjax.engine.speculative import draft_prefill, speculative_dispatch

log = logging.getLogger("rjax.runtime.serving")

# `precompile_first` builds the prefill program for one prompt of up to this many tokens first.
FIRST_PROMPT_TOKENS = 128


class ServingPrograms:
    """The programs of a `rjax.runtime.runner.Runner`'s steps, by what they are for."""

    def __init__(self, runner):
        self.runner, self.config = runner, runner.config
        self.background: BackgroundCompile | None = None  # precompile_first's programs still building
        self.building: dict[tuple, str] = {}                # every program's name, by what it is for

    def prefill_shapes(self, prompt_lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """The (prompt count bucket, chunk length bucket) pairs a prefill call can take: a
        prompt longer than `chunk_tokens` goes in chunks of that many, and a call packs chunks
        within `max_prefill_tokens`. `prompt_lengths`: only the chunks of prompts of these
        lengths (default: every bucket up to a chunk)."""
        c = self.config
        if prompt_lengths is None:
            longest = steps.prompt_bucket(min(c.max_len - 1, c.chunk_tokens))
            lengths = [t for t in steps.PROMPT_BUCKETS if t <= longest]
        else:
            chunks = set()
            for n in prompt_lengths:
                n = min(max(int(n), 1), c.max_len - 1)
                chunks.add(min(n, c.chunk_tokens))
                if n > c.chunk_tokens and n % c.chunk_tokens:
                    chunks.add(n % c.chunk_tokens)
            lengths = sorted({steps.prompt_bucket(n) for n in chunks})
        counts = sorted({c.prefill_bucket(n) for n in range(1, min(c.n_slots, c.max_prefill_prompts) + 1)})
        return [(p, t) for p in counts for t in lengths if p == 1 or p * t <= c.max_prefill_tokens]

    def programs(self, prompt_lengths: Sequence[int] | None = None, logprobs: bool = False) -> dict[tuple, Program]:
        """The programs a step may call, by what they are for: ("decode", batch, steps, logprobs,
        greedy, filters, adjust), ("speculative", batch, greedy), ("catch-up", batch),
        ("prefill", prompts, tokens) (with a draft model: also ("draft prefill", prompts, tokens))."""
        c, r = self.config, self.runner
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        # Sampling (with and without top-k / top-p filters) and greedy variants, and the one with
        # logit adjustments and masks (see Scheduler.sampling), also of one step, which constrained
        # requests decode by (the host computes each next mask). Adjusted with log-probabilities,
        # a rarer mix, compiles on first use.
        N = c.steps_per_dispatch
        variants = [(N, lp, g, f, False) for lp in ((False, True) if logprobs else (False,))
                    for g, f in ((False, True), (False, False), (True, True))]
        variants += [(n, False, False, True, True) for n in sorted({N, 1})]
        programs = {("decode", b, n, lp, g, f, a): decode_dispatch_program(
            r.cfg, r.params, r.cache, r.slots, n, lp, b if c.paged else None, g, f, a)
            for b in c.decode_buckets for n, lp, g, f, a in variants}
        model = r.draft_model
        if c.speculative:
            programs |= {("speculative", b, g): Program(
                f"speculative B={b} K={c.draft_tokens} N={c.steps_per_dispatch}{' greedy' if g else ''}",
                speculative_dispatch, (r.cfg, r.params, r.cache, r.slots, r.drafter, r.draft_params,
                                       (r.draft_cache, r.pending) if model else (i32(b, c.max_len + 1), i32(b)),
                                       c.draft_tokens, c.steps_per_dispatch, i32(b) if c.paged else None, g))
                for b in c.decode_buckets for g in (False, True)}
        shapes = self.prefill_shapes(prompt_lengths)
        if model and logprobs:  # the draft cache catching up after plain decoding (unless a prefill shape)
            T = r.catch_up_tokens
            programs |= {("catch-up", b): Program(f"draft catch-up P={b} T={T}", draft_prefill,
                                                  (r.drafter.cfg, r.draft_params, r.draft_cache, r.pending,
                                                   i32(b, T), i32(b), i32(b)))
                         for b in c.decode_buckets if (b, T) not in shapes}
        for p, t in shapes:
            programs["prefill", p, t] = prefill_into_slots_program(r.cfg, r.params, r.cache, r.slots, p, t)
            if model:
                programs["draft prefill", p, t] = Program(f"draft prefill P={p} T={t}", draft_prefill, (
                    r.drafter.cfg, r.draft_params, r.draft_cache, r.pending, i32(p, t), i32(p), i32(p)))
        return programs

    def precompile(self, prompt_lengths: Sequence[int] | None = None, workers: int | None = None,
                   progress: bool = False, logprobs: bool = False):
        return compile_programs(list(self.programs(prompt_lengths, logprobs).values()), workers, progress=progress)

    def precompile_first(self, logprobs: bool = False, workers: int | None = None, background_workers: int = 1,
                         first_tokens: int = FIRST_PROMPT_TOKENS):
        c, programs = self.config, self.programs(None, logprobs)
        P, B, N = c.prefill_bucket(1), c.decode_buckets[0], c.steps_per_dispatch
        T = max((t for p, t in self.prefill_shapes() if p == P and t <= steps.prompt_bucket(first_tokens)),
                default=steps.PROMPT_BUCKETS[0])
        first = {("prefill", P, T), ("draft prefill", P, T), ("decode", B, N, False, True, True, False),
                 ("decode", B, N, False, False, False, False), ("speculative", B, True), ("speculative", B, False)}
        report = compile_programs([p for k, p in programs.items() if k in first], workers)
        self.building = {k: p.name for k, p in programs.items()}
        self.background = BackgroundCompile([p for k, p in programs.items() if k not in first], background_workers)
        return report

    @property
    def compiling(self) -> list[str]:
        return [] if self.background is None else self.background.pending

    def stop_compiling(self) -> None:
        if self.background is not None:
            self.background.cancel()

    def _built(self, key: tuple) -> bool:
        name = self.building.get(key)
        return name is None or self.background.is_built(name)

    def _program(self, key: tuple, what: str, substitutes: Sequence[tuple] = ()) -> tuple:
        """The program to call for `key`: itself once built, else the first built of
        `substitutes` (programs that compute the same for these rows), else itself after
        waiting for it. Logs which, while programs are still compiling in the background."""
        if self._built(key):
            return key
        name = self.building[key]
        for sub in substitutes:
            if sub in self.building and self._built(sub):
                log.info("%s runs in %s while %s compiles", what, self.building[sub], name)
                return sub
        t = time.perf_counter()
        self.background.wait(name)
        log.info("%s waited %.1f s for %s to compile", what, time.perf_counter() - t, name)
        return key

    def prefill_shape(self, P: int, T: int) -> tuple[int, int]:
        """(prompts, tokens) of a prefill call of P prompts of up to T tokens: its own, or while
        programs compile in the background a larger one already built (the padding rows and
        positions write nothing). A draft model's prefill has to match, so it waits."""
        if self.background is None:
            return P, T
        shapes = [] if self.runner.draft_model else sorted(
            ((p, t) for k, p, t in (k for k in self.building if k[0] == "prefill") if p >= P and t >= T),
            key=lambda pt: pt[0] * pt[1])
        key = self._program(("prefill", P, T), f"a prefill of {P} prompt(s) of up to {T} tokens",
                            [("prefill", p, t) for p, t in shapes])
        if not self._built(("draft prefill", P, T)):
            self._program(("draft prefill", P, T), f"a draft prefill of {P} prompt(s) of up to {T} tokens")
        return key[1], key[2]

    def decode_program(self, B: int, n: int, lp: bool, greedy: bool, filters: bool, adjust: bool) -> tuple:
        """(batch, steps, logprobs, greedy, filters, adjust) of the decode dispatch to call: its
        own, or while programs compile in the background a built one that gives these rows the
        same tokens: more rows (padding rows are done), the log-probability variant, a sampled
        program for greedy rows, the filtering one for rows without top-k / top-p."""
        if self.background is None:
            return B, n, lp, greedy, filters, adjust
        variants = [(greedy, filters)] + ([(False, False), (False, True)] if greedy else
                                          [(False, True)] if not filters else [])
        subs = [] if adjust else [("decode", b, n, l, g, f, False) for b in self.config.decode_buckets if b >= B
                                  for l in {lp, True} for g, f in variants]
        return self._program(("decode", B, n, lp, greedy, filters, adjust), f"a decode dispatch of {B} row(s)",
                             subs)[1:]

    def speculative_program(self, B: int, greedy: bool) -> None:
        """Wait, while programs compile in the background, for the speculative dispatch's own."""
        if self.background is not None:
            self._program(("speculative", B, greedy), f"a speculative dispatch of {B} row(s)")

    def catch_up_program(self, P: int, T: int) -> None:
        """Wait, while programs compile in the background, for a draft catch-up's program."""
        if self.background is not None:
            self._program(("draft prefill", P, T) if (P, T) in self.prefill_shapes() else ("catch-up", P),
                          f"a draft catch-up of {P} row(s)")

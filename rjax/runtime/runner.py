"""The serving engine's runner: it owns the device state (the KV cache, the slot state
`rjax.engine.slots.SlotBatch`, a draft model's cache and pending tokens) and turns the scheduler's step
plans (`rjax.runtime.scheduler`) into calls of the jitted programs of `rjax.engine.slots` and
`rjax.engine.speculative`, marshalling host arrays in and tokens, log-probabilities and done flags
back out. Which compiled program runs a plan while others still compile in the background is
`rjax.runtime.serving_programs`' choice.

Log-probabilities cross to the host only where a request asked for them. A device program that
fails raises DispatchError naming the program and the sequences in it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine import steps
from rjax.engine.slots import (decode_dispatch, free_slots, init_slots, prefill_into_slots, set_masks, start_history,
                               stop_slots)
from rjax.engine.speculative import ModelDrafter, NgramDrafter, draft_prefill, speculative_dispatch
from rjax.math.cache import init_cache
from rjax.math.config import ModelConfig
from rjax.math.model import Params
from rjax.math.paged_cache import init_paged_cache, set_block_tables, set_lengths
from rjax.math.sampling import LogitAdjust, SamplingParams
from rjax.math.tensor_parallel import place_cache
from rjax.runtime.scheduler import CatchUpPlan, DecodePlan, PrefillPlan, SpeculativePlan, fault
from rjax.runtime.serving_limits import ServingConfig
from rjax.runtime.serving_programs import ServingPrograms


def run_program(fn, *args):
    """Call one device program of a step and wait for its results, so that a device error
    (XLA's RESOURCE_EXHAUSTED, say), raised by the call or while the program runs, surfaces here
    and not later where some result is read."""
    return jax.block_until_ready(fn(*args))


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A decode dispatch called and not yet read: its plan, its program's name, and its results on
    the device (tokens, done flags, TopLogprobs or None)."""
    plan: DecodePlan
    program: str
    out: jax.Array
    done: jax.Array
    lp: object


class DispatchError(RuntimeError):
    """A step's device program failed; `requests` were in it."""

    def __init__(self, program: str, requests, cause: BaseException):
        super().__init__(f"the device failed running {program}: {type(cause).__name__}: {cause}")
        self.program, self.requests, self.cause = program, list(requests), cause


def put(*host_arrays):
    """NumPy arrays to the device as a plain transfer: `jnp.asarray` of a NumPy array compiles
    a small `stage` program for every new shape, which a running server must not do."""
    out = jax.device_put(host_arrays)
    return out[0] if len(out) == 1 else out


def _host(tree):
    return jax.tree.map(np.asarray, tree)


class Runner:
    """The device side of one serving engine: `cfg`/`params` the target model, `draft`: the
    draft model's (config, params) of ServingConfig(speculative="model"), or None."""

    def __init__(self, cfg: ModelConfig, params: Params, config: ServingConfig,
                 draft: tuple[ModelConfig, Params] | None = None):
        self.cfg, self.config = cfg, config
        self.params = steps.program_params(params, config.dtype)
        self.drafter = {None: None, "ngram": NgramDrafter(), "model": ModelDrafter(draft[0]) if draft else None}[
            config.speculative]
        self.draft_params = steps.program_params(draft[1], config.dtype) if draft is not None else None
        self.cache = self.draft_cache = self.pending = None
        self.allocate()
        self.programs = ServingPrograms(self)

    def allocate(self) -> None:
        """A fresh cache and slot state, every slot free (the old buffers are dropped first). The
        draft model's cache is its own pool (paged: with the target's block tables, set together,
        so a page shared by prefix holds the draft's K/V of the same tokens), and each slot's
        pending token (rjax.engine.speculative), both carried between dispatches."""
        c = self.config
        self.cache = self.draft_cache = self.pending = None
        self.cache = self._new_cache(self.cfg, self.params)
        if self.draft_params is not None:
            self.draft_cache = self._new_cache(self.drafter.cfg, self.draft_params)
            self.pending = jnp.full((c.n_slots,), -1, jnp.int32)
        self.slots = init_slots(c.n_slots, c.max_stop_ids, self.cfg.vocab_size)

    def _new_cache(self, cfg: ModelConfig, params: Params):
        """An empty cache for `cfg` of this engine's kind, slots, pages and dtypes."""
        c = self.config
        if c.paged:
            cache = init_paged_cache(cfg, c.n_slots, c.pool_pages, c.page_size, c.max_len, c.dtype,
                                     kv_dtype=c.cache_kv_dtype)
        else:
            cache = init_cache(cfg, c.n_slots, c.max_len, c.dtype, kv_dtype=c.cache_kv_dtype)
        return place_cache(cache, params.tp)

    @property
    def draft_model(self) -> bool:
        return isinstance(self.drafter, ModelDrafter)

    def run(self, program: str, seqs, fn, *args):
        """`run_program`, its failure a DispatchError naming the program and its sequences."""
        return self.launch(program, seqs, run_program, fn, *args)

    def launch(self, program: str, seqs, fn, *args):
        """fn(*args), its failure a DispatchError naming the program and its sequences."""
        try:
            return fn(*args)
        except Exception as e:
            raise DispatchError(program, seqs, e) from e

    def state_ok(self) -> bool:
        """Whether the cache and slot state are still whole: not donated to a call that failed,
        and not the results of one."""
        leaves = jax.tree.leaves((self.cache, self.slots, self.draft_cache, self.pending))
        if any(x.is_deleted() for x in leaves):
            return False
        try:
            jax.block_until_ready(leaves)
        except Exception:
            return False
        return True

    # -- per-slot updates -------------------------------------------------------------------

    def _slot_rows(self, slots: list[int]) -> np.ndarray:
        """`slots` padded to n_slots entries with the out-of-range index n_slots (ignored by the
        updates), so that every update of a few slots is one compiled program."""
        rows = np.full(self.config.n_slots, self.config.n_slots, np.int32)
        rows[: len(slots)] = slots
        return rows

    def free(self, slots: list[int]) -> None:
        """Reset the lengths (and tables) of `slots`, whose sequences ended."""
        if not slots:
            return
        rows = put(self._slot_rows(slots))
        self.cache = free_slots(self.cache, rows)
        if self.draft_cache is not None:
            self.draft_cache = free_slots(self.draft_cache, rows)

    def stop(self, slots: list[int]) -> None:
        """Mark `slots` done on the device, so no dispatch writes them."""
        self.slots = stop_slots(self.slots, put(self._slot_rows(slots)))

    def start_history(self, slot: int, prompt: list[int]) -> None:
        """The token history of a slot whose request penalizes repeats, before any prefill: its
        first token is penalized too."""
        host = np.full(self.config.max_len, -1, np.int32)
        host[: len(prompt)] = prompt
        self.slots = start_history(self.slots, np.int32(slot), put(host))

    def sync_tables(self, slots, tables: np.ndarray) -> None:
        """The block tables of `slots` from the page allocator's `tables`, in both caches."""
        if not slots:
            return
        rows = self._slot_rows(list(slots))
        rows, tables = put(rows, tables[np.minimum(rows, self.config.n_slots - 1)])
        self.cache = set_block_tables(self.cache, rows, tables)
        if self.draft_cache is not None:
            self.draft_cache = set_block_tables(self.draft_cache, rows, tables)

    def set_lengths(self, slots: list[int], lengths: list[int]) -> None:
        """Slots whose tables start with shared prefix pages hold those positions already."""
        values = np.zeros(self.config.n_slots, np.int32)
        values[: len(lengths)] = lengths
        rows, values = put(self._slot_rows(slots), values)
        self.cache = set_lengths(self.cache, rows, values)
        if self.draft_cache is not None:
            self.draft_cache = set_lengths(self.draft_cache, rows, values)

    # -- step plans -------------------------------------------------------------------------

    @staticmethod
    def prefill_setup(batch) -> tuple[dict, list]:
        """Each prefilling sequence's host-side set-up, alone: its logit adjustment rows and,
        where this is its last chunk, its constraint's first mask. One that raises fails by
        itself. -> ({id(seq): (adjust rows, mask or None)}, faults)."""
        setup, faults = {}, []
        for r, n in batch:
            try:
                adjust_rows = LogitAdjust.host([r.request.adjust])
            except Exception as e:
                faults.append((r, fault("sampling set-up", e)))
                continue
            try:
                constraint = r.request.constraint
                last_chunk = r.prefilled + n == len(r.prompt)
                setup[id(r)] = adjust_rows, constraint.mask() if last_chunk and constraint is not None else None
            except Exception as e:
                faults.append((r, fault("constraint", e)))
        return setup, faults

    def prefill(self, plan: PrefillPlan, setup: dict) -> tuple:
        """One prefill call of `plan` (and the draft model's of the same tokens). -> (first
        tokens [P], done [n_slots], host TopLogprobs or None), as NumPy."""
        c, reqs, n = self.config, list(plan.seqs), len(plan.seqs)
        P, T = self.programs.prefill_shape(plan.prompts, plan.tokens)
        tokens, lengths = steps.pad_prompts([list(ch) for ch in plan.chunks], T)
        tokens = np.pad(tokens, ((0, P - n), (0, 0)))
        lengths = np.pad(lengths, (0, P - n))  # padding prompts: length 0, nothing written
        rows = np.full(P, reqs[0].slot, np.int32)
        rows[:n] = [r.slot for r in reqs]
        # A chunk before a prompt's last is written and advances the slot, but starts nothing.
        valid = np.pad(np.asarray(plan.last, bool), (0, P - n))
        pad = [reqs[0]] * (P - n)
        sp = SamplingParams(*put(np.asarray([r.request.temperature for r in reqs + pad], np.float32),
                                 np.asarray([r.request.top_k for r in reqs + pad], np.int32),
                                 np.asarray([r.request.top_p for r in reqs + pad], np.float32)))
        stops = np.full((P, c.max_stop_ids), -1, np.int32)
        for i, r in enumerate(reqs):
            stops[i, : len(r.request.stop_ids)] = r.request.stop_ids
        budget = np.asarray([r.request.max_new_tokens for r in reqs + pad], np.int32)
        seeds = np.asarray([[r.seed & 0xFFFFFFFF, r.seed >> 32] for r in reqs + pad], np.uint32)
        index = np.asarray([r.request.sample_index for r in reqs + pad], np.uint32)
        adjust = LogitAdjust(*put(*(np.concatenate(field) for field in zip(*(setup[id(r)][0] for r in reqs + pad)))))
        masks = np.full((P, self.slots.mask.shape[1]), -1, np.int32)
        for i, r in enumerate(reqs):
            if setup[id(r)][1] is not None:
                masks[i] = setup[id(r)][1]
        tokens, lengths, rows = put(tokens, lengths, rows)
        first, lp, self.slots, self.cache = self.run(
            f"prefill P={P} T={T}", reqs, prefill_into_slots, self.cfg, self.params, self.cache, self.slots, tokens,
            lengths, rows, *put(valid, seeds, index), sp, *put(budget, stops), adjust, put(masks))
        if self.draft_cache is not None:  # the draft model writes every position the target writes
            self.draft_cache, self.pending = self.run(
                f"draft prefill P={P} T={T}", reqs, draft_prefill, self.drafter.cfg, self.draft_params,
                self.draft_cache, self.pending, tokens, lengths, rows)
        if not any(plan.last):
            return None, None, None
        # Only what a request asked for crosses to the host.
        want_lp = any(r.request.logprobs for r, last in zip(reqs, plan.last) if last)
        return np.asarray(first), np.asarray(self.slots.state.done), _host(lp) if want_lp else None

    def decode(self, plan: DecodePlan) -> tuple:
        """One decode dispatch of `plan`. -> (tokens [n_slots, steps], done [n_slots], host
        TopLogprobs or None), as NumPy."""
        return self.read(self.launch_decode(plan))

    def launch_decode(self, plan: DecodePlan, wait: bool = True) -> InFlight:
        """Call the decode dispatch of `plan`; with `wait`, wait for it to finish (as `run`),
        else return as soon as it is queued on the device, its results still to be `read`."""
        c = self.config
        B, n, lp_call, greedy, filters, adjust = self.programs.decode_program(
            plan.batch, plan.steps, plan.logprobs, plan.greedy, plan.filters, plan.adjust)
        rows = None if plan.rows is None else put(np.array(list(plan.rows) + [c.n_slots] * (B - len(plan.rows)),
                                                           np.int32))
        if plan.masks:
            host = np.full((c.n_slots, self.slots.mask.shape[1]), -1, np.int32)
            for i, mask in enumerate(plan.masks.values()):
                host[i] = mask
            self.slots = set_masks(self.slots, *put(self._slot_rows(list(plan.masks)), host))
        name = f"decode B={B} N={n}{' logprobs' if lp_call else ''}"
        out, lp, self.slots, self.cache = (self.run if wait else self.launch)(
            name, list(plan.seqs), decode_dispatch,
            self.cfg, self.params, self.cache, self.slots, n, lp_call, rows, greedy, filters, adjust)
        return InFlight(plan, name, out, self.slots.state.done, lp if plan.logprobs else None)

    def keep(self, flight: InFlight) -> InFlight:
        """`flight` with its done flags copied out of the slot state (a device-to-device copy,
        no program), which the next dispatch takes over: launched before this one is read."""
        return dataclasses.replace(flight, done=jax.device_put(flight.done, may_alias=False))

    def read(self, flight: InFlight) -> tuple:
        """A launched decode dispatch's (tokens, done, host TopLogprobs or None), as NumPy; its
        failure while it ran a DispatchError."""
        try:
            return np.asarray(flight.out), np.asarray(flight.done), None if flight.lp is None else _host(flight.lp)
        except Exception as e:
            raise DispatchError(flight.program, flight.plan.seqs, e) from e

    def speculative(self, plan: SpeculativePlan) -> tuple:
        """One speculative dispatch of `plan`. -> (tokens, drafted, accepted, done, and with a
        draft model its cache's lengths and pending tokens), as NumPy."""
        c, K, B = self.config, self.config.draft_tokens, plan.batch
        self.programs.speculative_program(B, plan.greedy)
        rows = put(np.array(list(plan.rows) + [c.n_slots] * (B - len(plan.rows)), np.int32)) if c.paged else None
        if self.draft_model:
            draft = (self.draft_cache, self.pending)
        else:
            hist = np.zeros((B, c.max_len + 1), np.int32)
            n_hist = np.zeros(B, np.int32)
            for i, seq in enumerate(plan.histories):
                if seq is not None:
                    hist[i, : len(seq)] = seq
                    n_hist[i] = len(seq)
            draft = put(hist, n_hist)
        out, drafted, accepted, self.slots, self.cache, draft = self.run(
            f"speculative B={B} K={K} N={c.steps_per_dispatch}", list(plan.seqs), speculative_dispatch,
            self.cfg, self.params, self.cache, self.slots, self.drafter, self.draft_params, draft, K,
            c.steps_per_dispatch, rows, plan.greedy)
        out, drafted, accepted = np.asarray(out), np.asarray(drafted), np.asarray(accepted)
        done = np.asarray(self.slots.state.done)
        if not self.draft_model:
            return out, drafted, accepted, done, None, None
        self.draft_cache, self.pending = draft
        return out, drafted, accepted, done, np.asarray(self.draft_cache.lengths), np.asarray(self.pending)

    @property
    def catch_up_tokens(self) -> int:
        """Tokens per slot of a draft catch-up call: what one plain dispatch decodes, and the
        pending token (a longer lag takes several calls)."""
        return steps.prompt_bucket(self.config.steps_per_dispatch + 1)

    def catch_up(self, plan: CatchUpPlan) -> None:
        """Write into the draft model's cache the positions of `plan` (decoded plainly, for a
        request that asked for log-probabilities, while the draft model stood by)."""
        P, T = plan.prompts, self.catch_up_tokens
        self.programs.catch_up_program(P, T)
        tokens = np.zeros((P, T), np.int32)
        lengths = np.zeros(P, np.int32)   # padding rows: length 0, nothing written
        rows = np.full(P, plan.seqs[0].slot, np.int32)
        for i, (r, chunk) in enumerate(zip(plan.seqs, plan.chunks)):
            tokens[i, : len(chunk)], lengths[i], rows[i] = chunk, len(chunk), r.slot
        self.draft_cache, self.pending = self.run(
            f"draft catch-up P={P} T={T}", list(plan.seqs), draft_prefill, self.drafter.cfg, self.draft_params,
            self.draft_cache, self.pending, *put(tokens, lengths, rows))

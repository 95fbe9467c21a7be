"""The paged KV cache: same numbers as the contiguous cache, writes confined to the slot's own
pages, the host page allocator and the pure block-table updates (small synthetic model, CPU)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from rjax.engine import steps
from rjax.loading.loaders.gguf import load_gguf
from rjax.loading.synth import write_synthetic
from rjax.math.cache import init_cache
from rjax.math.config import ModelConfig
from rjax.math.paged_cache import NO_PAGE, init_paged_cache, set_block_tables
from rjax.runtime.pages import PageAllocator, PagesExhaustedError

PS = 8  # page size
# One geometry for every paged cache in this file (4 slots, 16 pages, 32 positions per slot), so
# that the tests share compiled programs.
SLOTS, PAGES, MAX_LEN = 4, 16, 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_synthetic(path, "smollm2-135m", "q8_0", seed=3, n_layers=2, vocab_size=512, tokenizer_from="builtin")
    cfg, params, _ = load_gguf(path, progress=False)
    return cfg, params


def _prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, vocab, n)) for n in lengths]


def _paged_with_pages(cfg, slot_pages: dict[int, list[int]]):
    cache = init_paged_cache(cfg, SLOTS, PAGES, PS, MAX_LEN)
    tables = np.full((SLOTS, MAX_LEN // PS), NO_PAGE, np.int32)
    for s, pages in slot_pages.items():
        tables[s, : len(pages)] = pages
    return set_block_tables(cache, jnp.arange(SLOTS, dtype=jnp.int32), jnp.asarray(tables))


def test_paged_and_contiguous_caches_give_the_same_logits(tiny):
    """Multi-prompt prefill into chosen slots, then decode steps, through both caches. The pages
    are scattered and out of order, so a wrong page lookup would show."""
    cfg, params = tiny
    prompts = _prompts(0, [5, 13, 9], cfg.vocab_size)
    slots = jnp.asarray([3, 0, 2], jnp.int32)
    contiguous = init_cache(cfg, SLOTS, MAX_LEN)
    paged = _paged_with_pages(cfg, {3: [7, 1, 12, 4], 0: [0, 9, 15, 2], 2: [11, 5, 3, 13]})
    t, l = map(jnp.asarray, steps.pad_prompts(prompts))
    lc, contiguous = steps.prefill(cfg, params, contiguous, t, l, slots)
    lp, paged = steps.prefill(cfg, params, paged, t, l, slots)
    scale = float(jnp.abs(lc).max())
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lc), rtol=0, atol=1e-5 * scale)
    np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(contiguous.lengths))
    active = jnp.asarray([True, False, True, True])
    for _ in range(6):  # crosses a page boundary in every slot
        tok = jnp.argmax(lc, -1) if lc.shape[0] == 4 else jnp.zeros(4, jnp.int32).at[slots].set(jnp.argmax(lc, -1))
        lc, contiguous = steps.decode_step(cfg, params, contiguous, tok.astype(jnp.int32), active)
        lp, paged = steps.decode_step(cfg, params, paged, tok.astype(jnp.int32), active)
        np.testing.assert_allclose(np.asarray(lp)[np.asarray(active)], np.asarray(lc)[np.asarray(active)],
                                   rtol=0, atol=1e-5 * scale)
    np.testing.assert_array_equal(np.asarray(paged.lengths), [19, 0, 15, 11])


def test_multi_prompt_prefill_into_pages_equals_each_prompt_alone(tiny):
    cfg, params = tiny
    prompts = _prompts(1, [3, 16, 9], cfg.vocab_size)
    cache = _paged_with_pages(cfg, {0: [5, 6], 1: [0, 1], 3: [4, 7]})
    t, l = map(jnp.asarray, steps.pad_prompts(prompts))
    batched, cache = steps.prefill(cfg, params, cache, t, l, jnp.asarray([1, 0, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [16, 3, 0, 9])
    for i, p in enumerate(prompts):
        alone_cache = _paged_with_pages(cfg, {2: [2, 9]})
        alone, _ = steps.prefill(cfg, params, alone_cache, *map(jnp.asarray, steps.pad_prompts([p])),
                                  jnp.asarray([2], jnp.int32))
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(alone[0]),
                                   atol=1e-5 * float(jnp.abs(alone).max()))


def test_writes_touch_only_the_slots_own_pages(tiny):
    cfg, params = tiny
    cache = _paged_with_pages(cfg, {0: [0, 1], 1: [6, 3, 8], 2: [2]})
    # Sentinels everywhere: any write shows.
    cache = dataclasses.replace(cache, k=jnp.full_like(cache.k, 7.0), v=jnp.full_like(cache.v, -3.0))
    t, l = map(jnp.asarray, steps.pad_prompts(_prompts(2, [11], cfg.vocab_size)))
    _, cache = steps.prefill(cfg, params, cache, t, l, jnp.asarray([1], jnp.int32))
    k, v = np.asarray(cache.k), np.asarray(cache.v)
    changed = lambda a, s: (a != s).any(axis=(0, 2, 4))  # [n_pages, page_size]
    ck, cv = changed(k, 7.0), changed(v, -3.0)
    np.testing.assert_array_equal(ck, cv)
    # Slot 1 holds positions 0..7 on page 6 and 8..10 on page 3 (offsets 0..2); nothing else moved.
    expect = np.zeros_like(ck)
    expect[6, :] = True
    expect[3, :3] = True
    np.testing.assert_array_equal(ck, expect)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 11, 0, 0])

    # Decode: slot 2 writes position 0 of page 2; slots 0 and 3 are inactive; slot 1 writes page 3 offset 3.
    _, cache = steps.decode_step(cfg, params, cache, jnp.asarray([1, 2, 3, 4], jnp.int32),
                                  jnp.asarray([False, True, True, False]))
    ck = changed(np.asarray(cache.k), 7.0)
    expect[3, 3] = True
    expect[2, 0] = True
    np.testing.assert_array_equal(ck, expect)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [0, 12, 1, 0])


def test_a_position_without_a_page_is_dropped_not_redirected(tiny):
    cfg, params = tiny
    cache = _paged_with_pages(cfg, {0: [4], 1: [0, 1, 2, 3]})
    cache = dataclasses.replace(cache, k=jnp.full_like(cache.k, 7.0))
    # A 12-token prompt into slot 0, which owns one page: positions 8..11 have nowhere to go.
    t, l = map(jnp.asarray, steps.pad_prompts(_prompts(3, [12], cfg.vocab_size)))
    _, cache = steps.prefill(cfg, params, cache, t, l, jnp.asarray([0], jnp.int32))
    ck = (np.asarray(cache.k) != 7.0).any(axis=(0, 2, 4))
    expect = np.zeros_like(ck)
    expect[4, :] = True
    np.testing.assert_array_equal(ck, expect)


def test_reset_and_block_table_updates_are_pure_and_skip_padding_rows(tiny):
    cfg, _ = tiny
    cache = _paged_with_pages(cfg, {0: [1, 2], 1: [3], 2: [4, 5], 3: [6]})
    cache = dataclasses.replace(cache, lengths=jnp.asarray([10, 4, 12, 2], jnp.int32))
    before = np.asarray(cache.block_tables)
    reset = cache.reset(jnp.asarray([1, 4], jnp.int32))  # 4 is padding (>= n_slots)
    np.testing.assert_array_equal(np.asarray(reset.lengths), [10, 0, 12, 2])
    np.testing.assert_array_equal(np.asarray(reset.block_tables), [before[0], [NO_PAGE] * 4, before[2], before[3]])
    np.testing.assert_array_equal(np.asarray(cache.block_tables), before)  # the input is unchanged
    rows = jnp.asarray([1, 4, 4, 4], jnp.int32)
    updated = set_block_tables(reset, rows, jnp.asarray([[6, 7, NO_PAGE, NO_PAGE]] + [[0] * 4] * 3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(updated.block_tables),
                                  [before[0], [6, 7, NO_PAGE, NO_PAGE], before[2], before[3]])


def test_init_errors_name_the_limit(tiny):
    cfg, _ = tiny
    with pytest.raises(ValueError, match="power of two"):
        init_paged_cache(cfg, 2, 8, 12, 48)
    with pytest.raises(ValueError, match="not a multiple of the page size 16"):
        init_paged_cache(cfg, 2, 8, 16, 40)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        init_paged_cache(cfg, 2, 8, 16, cfg.context_length + 16)


# --- the host allocator -----------------------------------------------------------------------

def test_allocator_grows_within_reservations_and_recycles_pages():
    a = PageAllocator(n_pages=6, n_slots=3, max_pages=4, page_size=4)
    a.reserve(0, 3)
    a.reserve(2, 2)
    assert a.unreserved == 1
    assert a.grow(0, 5) and list(a.tables[0]) == [0, 1, NO_PAGE, NO_PAGE]
    assert not a.grow(0, 8)  # still two pages
    assert a.grow(2, 1) and list(a.tables[2]) == [2, NO_PAGE, NO_PAGE, NO_PAGE]
    assert a.grow(0, 9) and list(a.tables[0]) == [0, 1, 3, NO_PAGE]
    assert a.n_free == 2
    a.release(0)
    assert a.n_free == 5 and a.unreserved == 4 and (a.tables[0] == NO_PAGE).all()
    a.reserve(1, 4)
    a.grow(1, 16)
    owned = set(a.tables[1]) | {int(a.tables[2, 0])}
    assert len(owned) == 5 and owned <= set(range(6))  # no page is handed out twice


def test_allocator_refuses_what_it_cannot_promise_and_changes_nothing():
    a = PageAllocator(n_pages=4, n_slots=2, max_pages=8, page_size=4)
    a.reserve(0, 3)
    snapshot = (a.tables.copy(), a.owned.copy(), a.reserved.copy(), a.n_free)
    with pytest.raises(PagesExhaustedError, match=r"2 pages requested, 1 of 4 are unreserved"):
        a.reserve(1, 2)
    with pytest.raises(PagesExhaustedError, match=r"16 positions need 4 pages, beyond its reservation of 3"):
        a.grow(0, 16)
    with pytest.raises(PagesExhaustedError, match="block table has 8"):
        a.reserve(1, 9)
    with pytest.raises(ValueError, match="already holds a reservation"):
        a.reserve(0, 1)
    for x, y in zip(snapshot[:3], (a.tables, a.owned, a.reserved)):
        np.testing.assert_array_equal(x, y)
    assert a.n_free == snapshot[3]


def test_attend_through_the_pallas_kernels_reads_the_right_layer(monkeypatch):
    """On GPUs `attend` runs the Pallas kernels over all layers' pages at once with per-layer
    table offsets; here they run in interpret mode against the reference on one layer's pool."""
    import functools

    import jax

    from pallas_kernels.attention import paged_attention
    from rjax.math import paged_cache

    L, P, H, ps, D = 3, 8, 2, 16, 32
    k = jax.random.normal(jax.random.key(0), (L, P, H, ps, D))
    v = jax.random.normal(jax.random.key(1), (L, P, H, ps, D))
    tables = jnp.asarray([[3, 1, NO_PAGE, NO_PAGE], [0, 5, 6, NO_PAGE]], jnp.int32)
    cache = paged_cache.PagedKVCache(k, v, tables, jnp.asarray([21, 41], jnp.int32))
    monkeypatch.setattr(paged_cache, "paged_attention", functools.partial(paged_attention, implementation="interpret"))
    for T, first in ((1, [20, 40]), (12, [9, 29])):  # the decode kernel, then the prefill kernel
        q = jax.random.normal(jax.random.key(T), (2, T, 4, D))
        pos = jnp.asarray([[f + t for t in range(T)] for f in first], jnp.int32)
        for layer in (0, 2):
            got = cache.attend(layer, q, pos, None, scale=0.125, window=None)
            want = paged_attention(q, k[layer], v[layer], tables, pos, pos[:, -1] + 1, scale=0.125,
                                   implementation="reference")
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_rope_write_puts_each_token_on_its_page(monkeypatch, kv_dtype):
    """The rotate-and-append kernel (interpret mode) and its reference write a decode step's and a
    verification's tokens into the pages their slots' tables name, at the layer asked, and nowhere
    else: the same entries, and the same rotated queries, as a contiguous cache's `rope_write`.
    Padding (position -1) and a position whose page the slot does not own write nothing."""
    import functools

    import jax

    from pallas_kernels.kv_append import rope_append
    from rjax.math import paged_cache

    L, P, Hq, H, ps, D = 3, 8, 4, 2, 4, 32
    cfg = ModelConfig(arch="llama", n_layers=L, d_model=Hq * D, d_ff=64, n_heads=Hq, n_kv_heads=H, head_dim=D,
                      vocab_size=64, context_length=4 * ps, rms_eps=1e-5, rope_theta=10000.0)
    paged = init_paged_cache(cfg, 2, P, ps, 4 * ps, jnp.float32, kv_dtype)
    tables = jnp.asarray([[3, 1, NO_PAGE, NO_PAGE], [0, 5, 6, NO_PAGE]], jnp.int32)
    paged = set_block_tables(paged, jnp.arange(2), tables)
    contiguous = init_cache(cfg, 2, 4 * ps, jnp.float32, kv_dtype)
    inv = 1.0 / (10000.0 ** (jnp.arange(D // 2) / (D // 2)))
    for T, pos in ((1, [[6], [9]]), (3, [[7, 8, -1], [10, 11, 12]])):  # slot 0 owns no page for 8
        pos = jnp.asarray(pos, jnp.int32)
        parts = jax.random.normal(jax.random.key(T), (2, 2, T, (Hq + 2 * H) * D))
        kw = dict(n_heads=Hq, pairing="halves", dtype=jnp.float32)
        want_q, want = contiguous.rope_write(1, parts, None, pos, None, inv, **kw)
        tol = dict(bf16=dict(rtol=1e-6, atol=1e-6), int8=dict(rtol=0, atol=1.0), fp8=dict(rtol=0.13, atol=0))[kv_dtype]
        for impl in ("interpret", "reference"):
            monkeypatch.setattr(paged_cache, "rope_append", functools.partial(rope_append, implementation=impl))
            q, got = paged.rope_write(1, parts, None, pos, None, inv, **kw)
            np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=0, atol=1e-6)
            for name in ("k", "v"):
                g = np.asarray(jnp.asarray(getattr(got, name), jnp.float32))
                w = np.asarray(jnp.asarray(getattr(want, name)[1], jnp.float32))  # [slots, H, S, D]
                changed = (g != 0).any(axis=(2, 4))  # [L, P, ps]
                expect = np.zeros_like(changed)
                for b in range(2):
                    for p in np.asarray(pos[b]):
                        page = int(tables[b, p // ps]) if p >= 0 else NO_PAGE
                        if page == NO_PAGE:
                            continue
                        expect[1, page, p % ps] = True
                        # The kernel's float32 rotation may differ from XLA's in the last bit, which
                        # can move a quantized value by one step of its format.
                        np.testing.assert_allclose(g[1, page, :, p % ps], w[b, :, p], **tol)
                np.testing.assert_array_equal(changed, expect, err_msg=f"{impl} {name} T={T}")
            if kv_dtype == "int8":
                ks = np.asarray(got.k_scale)[1]  # [P, H, ps]
                for b in range(2):
                    for p in np.asarray(pos[b]):
                        if p >= 0 and int(tables[b, p // ps]) != NO_PAGE:
                            np.testing.assert_allclose(ks[int(tables[b, p // ps]), :, p % ps],
                                                       np.asarray(want.k_scale[1])[b, :, p], rtol=1e-6)

"""rotary.KVCache as an engine's cache (issue 42): one pool for all layers (steps), sequences as slots, shared pages
with holder counts (fork, copy on write, prefix reuse), rollback (truncate), position-independent reuse (export /
insert, against the float64 oracle), sliding-window caches that give pages back; bad calls leave the cache bit for
bit unchanged."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import rotary
from rotary.kvcache.store import KVCacheFullError, KVChunk
from rotary.testing import rope_complex

from .conftest import backend_params

CPU_BACKENDS = [p for p in backend_params() if p.values[0] != "cupy"]
H, D = 2, 16


def spec16(**kw):
    return rotary.RopeSpec(D, base=100.0, **kw)


def paged(backend="auto", **kw):
    args = dict(batch=4, kv_heads=H, head_dim=D, page_size=4, num_pages=16, backend=backend)
    args.update(kw)
    return rotary.KVCache(kw.pop("spec", None) or spec16(), **{k: v for k, v in args.items() if k != "spec"})


def tokens(rng, n, dtype=np.float32):
    return rng.standard_normal((n, H, D)).astype(dtype)


def state(cache):
    return (cache.lengths.copy(), cache.block_table.copy(), cache.free_pages, cache.active.tolist(),
            [None if a is None else a.copy() for a in cache._pools])


def assert_state(cache, snap):
    lengths, table, free, active, pools = snap
    np.testing.assert_array_equal(cache.lengths, lengths)
    np.testing.assert_array_equal(cache.block_table, table)
    assert cache.free_pages == free and cache.active.tolist() == active
    for a, b in zip(cache._pools, pools):
        if b is not None:
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def oracle_keys(k, positions, spec=None):
    spec = spec or spec16()
    inv = spec.base ** (-np.arange(0, spec.rotary_dim, 2, dtype=np.float64) / spec.rotary_dim)
    return rope_complex(np.asarray(k, np.float64).transpose(1, 0, 2), np.asarray(positions), inv).transpose(1, 0, 2)


# -- one pool for every layer -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_layers_share_one_table_and_equal_separate_caches(backend, rng):
    """A 3-layer cache: layer 0's append takes the step's pages, layers 1 and 2 write the same slots; each layer's
    keys and attention equal a single-layer cache fed that layer's tokens (bit for bit)."""
    L = 3
    multi = paged(backend, layers=L)
    singles = [paged(backend) for _ in range(L)]
    cu = np.array([0, 5, 6, 13])
    ks = [tokens(rng, 13) for _ in range(L)]
    for i in range(L):
        multi.append(ks[i], ks[i] * 2, seq_ids=[0, 2, 3], cu_seqlens=cu, layer=i)
        singles[i].append(ks[i], ks[i] * 2, seq_ids=[0, 2, 3], cu_seqlens=cu)
    for step in range(2):
        kd = [rng.standard_normal((3, 1, H, D)).astype(np.float32) for _ in range(L)]
        multi.reserve([0, 2, 3], 1) if step else None
        for i in range(L):
            multi.layer(i).append(kd[i], kd[i], seq_ids=[0, 2, 3])
            singles[i].append(kd[i], kd[i], seq_ids=[0, 2, 3])
    assert multi.k_pool.shape[0] == L and multi.lengths.tolist() == [7, 0, 3, 9]
    q = rng.standard_normal((3, 1, 4, D)).astype(np.float32)
    for i in range(L):
        np.testing.assert_array_equal(multi.keys(3, layer=i), singles[i].keys(3))
        np.testing.assert_array_equal(rotary.attention(q, multi.layer(i), seq_ids=[0, 2, 3]),
                                      rotary.attention(q, singles[i], seq_ids=[0, 2, 3]))


def test_a_step_is_written_by_every_layer_in_order(rng):
    cache = paged(layers=2)
    k = rng.standard_normal((4, 1, H, D)).astype(np.float32)
    with pytest.raises(ValueError, match="layer 1 appends before layer 0"):
        cache.append(k, k, layer=1)
    with pytest.raises(ValueError, match="pass layer="):
        cache.append(k, k)
    cache.append(k, k, layer=0)
    snap = state(cache)
    for bad, match in ((lambda: cache.append(k, k, layer=0), "layer 0 has appended this step's keys already"),
                       (lambda: cache.append(k[:2], k[:2], seq_ids=[0, 1], layer=1), "other sequences"),
                       (lambda: cache.append(np.concatenate([k, k], 1), np.concatenate([k, k], 1), layer=1),
                        "token counts"),
                       (lambda: cache.free([0]), r"free waits for the step under way: layers \[1\]"),
                       (lambda: cache.fork(0), "fork waits"),
                       (lambda: rotary.attention(k[:, :, :1].repeat(2, 2), cache.layer(1)), "attends before appending"),
                       (lambda: cache.append(k, k, layer=2), r"layer must be in \[0, 2\)")):
        with pytest.raises(ValueError, match=match):
            bad()
        assert_state(cache, snap)
    cache.append(k, k, layer=1)
    assert cache._step is None and cache.lengths.tolist() == [1, 1, 1, 1]


def test_a_layer_views_prepared_calls_keep_the_step_checks(rng):
    """cache.layer(i)'s append and attend, run through the step's prepared calls, refuse what cache.append /
    cache.attend refuse: a layer appending twice, a layer attending before its append (the cache unchanged)."""
    cache = paged(layers=3)
    k = rng.standard_normal((4, 1, H, D)).astype(np.float32)
    q = rng.standard_normal((4, 1, 2 * H, D)).astype(np.float32)
    layers = [cache.layer(i) for i in range(3)]
    for _ in range(2):   # (the second step: a decode chain)
        layers[0].append(k, k)
        layers[0].attend(q)
        layers[1].append(k, k)   # the prepared append
        snap = state(cache)
        for bad, match in ((lambda: layers[1].append(k, k), "layer 1 has appended this step's keys already"),
                           (lambda: layers[2].attend(q), "layer 2 attends before appending"),
                           (lambda: cache.attend(q, layer=2), "layer 2 attends before appending")):
            with pytest.raises(ValueError, match=match):
                bad()
            assert_state(cache, snap)
        layers[1].attend(q)   # the prepared attention
        layers[2].append(k, k)
        np.testing.assert_allclose(layers[2].attend(q), attention_oracle(cache, 2, q), atol=2e-5, rtol=0)
    assert cache._step is None and cache.lengths.tolist() == [2, 2, 2, 2]


# -- sequences as slots ---------------------------------------------------------------------------------------------
def test_add_active_free(rng):
    cache = paged(batch=3)
    assert [cache.add(), cache.add()] == [0, 1] and cache.active.tolist() == [0, 1]
    cache.free([0])
    assert cache.active.tolist() == [1] and cache.add() == 0
    cache.add()
    snap = state(cache)
    with pytest.raises(KVCacheFullError, match="every one of the cache's 3 sequence slots is in use"):
        cache.add()
    assert_state(cache, snap)
    k = tokens(rng, 2)[None]
    cache.free([2])
    cache.append(k, k, seq_ids=[2])   # an append makes its sequence active too
    assert cache.active.tolist() == [0, 1, 2]


# -- shared pages --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fork_shares_pages_and_copies_the_partial_page_on_write(backend, rng):
    cache = paged(backend)
    base = cache.free_pages
    src = cache.add()
    prompt = tokens(rng, 10)    # pages: 4 + 4 + 2 tokens
    cache.append(prompt[None], prompt[None], seq_ids=[src])
    dst = cache.fork(src)
    assert cache.block_table[dst, :3].tolist() == cache.block_table[src, :3].tolist()
    assert cache.free_pages == base - 3   # no page taken by the fork
    a, b = tokens(rng, 1), tokens(rng, 1)
    cache.append(a[None], a[None], seq_ids=[src])
    cache.append(b[None], b[None], seq_ids=[dst])
    assert cache.block_table[dst, 2] != cache.block_table[src, 2]   # the partial page: copied on write
    assert cache.block_table[dst, :2].tolist() == cache.block_table[src, :2].tolist()
    for seq, tail in ((src, a), (dst, b)):
        want = oracle_keys(np.concatenate([prompt, tail]), np.arange(11))
        np.testing.assert_allclose(cache.keys(seq), want, atol=2e-6)
    cache.free([src, dst])
    assert cache.free_pages == base and sorted(cache._book.free_list) == list(range(cache._book.allocated))


def test_fork_of_part_into_a_chosen_slot_and_refusals(rng):
    cache = paged()
    k = tokens(rng, 9)
    cache.append(k[None], k[None], seq_ids=[0])
    assert cache.fork(0, dst=2, length=5) == 2 and cache.lengths[2] == 5
    np.testing.assert_array_equal(cache.keys(2), cache.keys(0)[:5])
    snap = state(cache)
    for bad, error, match in ((lambda: cache.fork(0, dst=2), ValueError, "dst = 2 is in use"),
                              (lambda: cache.fork(1), ValueError, "src = 1 is not a sequence in use"),
                              (lambda: cache.fork(0, length=10), ValueError, r"length must be in \[0, 9\]"),
                              (lambda: cache.fork(0, dst=7), ValueError, "out of range")):
        with pytest.raises(error, match=match):
            bad()
        assert_state(cache, snap)


def test_fork_on_a_contiguous_cache_copies(rng):
    cache = rotary.KVCache(spec16(), batch=2, kv_heads=H, head_dim=D, capacity=12)
    k = tokens(rng, 7)
    cache.append(k[None], k[None], seq_ids=[0])
    cache.fork(0)
    np.testing.assert_array_equal(cache.keys(1), cache.keys(0))


def test_free_never_returns_a_shared_page_twice(rng):
    """Today's defect: sharing by writing the public block table made free return a page twice."""
    cache = paged(num_pages=4, batch=3)
    k = tokens(rng, 8)
    cache.append(k[None], k[None], seq_ids=[0])
    cache.fork(0)
    cache.fork(0)
    cache.free([0, 1])
    assert cache.free_pages == 2
    cache.free([2])
    assert cache.free_pages == 4 and len(cache._book.free_list) == len(set(cache._book.free_list))


def test_prefix_reuse_shares_kept_pages_and_evicts_them_last(rng):
    cache = paged(num_pages=6)
    prompt = list(range(100, 111))   # 11 tokens: pages 0..3, 4..7 full; 8..10 partial
    k = tokens(rng, 11)
    a = cache.add(tokens=prompt)
    assert cache.lengths[a] == 0
    cache.append(k[None], k[None], seq_ids=[a])
    b = cache.add(tokens=prompt[:9] + [7, 7])   # shares pages 0 and 1 (8 tokens)
    assert cache.lengths[b] == 8 and cache.block_table[b, :2].tolist() == cache.block_table[a, :2].tolist()
    tail = tokens(rng, 3)
    cache.append(tail[None], tail[None], seq_ids=[b])
    np.testing.assert_array_equal(cache.keys(b)[:8], cache.keys(a)[:8])
    c = cache.add(tokens=[1, 2, 3, 4, 5])        # another prompt: nothing kept
    assert cache.lengths[c] == 0
    cache.free([a, b, c])
    assert cache._book.kept() == 2 and cache.free_pages == 6   # kept pages count as available
    d = cache.add(tokens=prompt)                 # still kept: reused
    assert cache.lengths[d] == 8
    cache.free([d])
    big = tokens(rng, 24)                        # needs every page: the kept ones are given back
    cache.append(big[None], big[None], seq_ids=[0])
    assert cache._book.kept() == 0 and cache.free_pages == 0
    cache.free([0])
    assert cache.add(tokens=prompt) == 0 and cache.lengths[0] == 0


def test_a_full_prompt_hit_still_leaves_its_last_page_to_prefill(rng):
    cache = paged()
    prompt = list(range(8))
    k = tokens(rng, 8)
    cache.append(k[None], k[None], seq_ids=[cache.add(tokens=prompt)])
    assert cache.lengths[cache.add(tokens=prompt)] == 4   # the last token's logits need a forward


# -- rollback ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_truncate_rolls_back_and_returns_pages(backend, rng):
    cache = paged(backend)
    base = cache.free_pages
    k = tokens(rng, 6)
    cache.append(k[None], k[None], seq_ids=[1])
    draft = tokens(rng, 5)
    cache.append(draft[None], draft[None], seq_ids=[1])   # 11 tokens: 3 pages
    cache.truncate([1], [7])                               # 2 drafts accepted: 2 pages
    assert cache.lengths[1] == 7 and cache.free_pages == base - 2
    nxt = tokens(rng, 1)
    cache.append(nxt[None], nxt[None], seq_ids=[1])
    want = oracle_keys(np.concatenate([k, draft[:1], nxt]), np.arange(8))
    np.testing.assert_allclose(cache.keys(1), want, atol=2e-6)
    snap = state(cache)
    for bad, match in ((lambda: cache.truncate([1], [9]), r"lengths\[0\] = 9: sequence 1 holds 8 tokens"),
                       (lambda: cache.truncate([1], [-1]), "lengths"),
                       (lambda: cache.truncate([1, 2], [1, 2, 3]), "one length per sequence")):
        with pytest.raises(ValueError, match=match):
            bad()
        assert_state(cache, snap)


# -- position-independent reuse ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["plain", "yarn", "layers"])
def test_insert_moves_an_exported_chunk_exactly(backend, kind, rng):
    """A document's keys cached at positions 0.. and inserted after a 13-token prefix equal the float64 oracle's keys
    at positions 13.. to float64 rounding; values as they were."""
    scaling = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16) if kind == "yarn" else None
    spec = rotary.RopeSpec(D, base=100.0, scaling=scaling, max_position_embeddings=64 if scaling else None)
    layers = 2 if kind == "layers" else None
    cache = rotary.KVCache(spec, batch=3, kv_heads=H, head_dim=D, page_size=4, num_pages=20, dtype=np.float64,
                           backend=backend, layers=layers)
    doc = rng.standard_normal((6, H, D))
    prefix = rng.standard_normal((13, H, D))
    for i in range(layers or 1):
        cache.append(doc[None], doc[None] + i, seq_ids=[0], layer=None if layers is None else i)
    chunk = cache.export(0)
    assert isinstance(chunk, KVChunk) and chunk.start == 0
    for i in range(layers or 1):
        cache.append(prefix[None], prefix[None], seq_ids=[1], layer=None if layers is None else i)
    cache.insert(1, chunk)
    fresh = rotary.KVCache(spec, batch=1, kv_heads=H, head_dim=D, capacity=32, dtype=np.float64, backend=backend)
    fresh.append(np.concatenate([prefix, doc])[None], np.concatenate([prefix, doc])[None])
    for i in range(layers or 1):
        got = cache.keys(1, layer=None if layers is None else i)
        np.testing.assert_allclose(got, fresh.keys(0), rtol=0, atol=1e-12)
        np.testing.assert_array_equal(cache.values(1, layer=None if layers is None else i)[13:], doc + i)


def test_insert_refusals_leave_the_cache_unchanged(rng):
    cache = paged(dtype=np.float64, capacity=16)
    doc = rng.standard_normal((6, H, D))
    cache.append(doc[None], doc[None], seq_ids=[0])
    chunk = cache.export(0, 2, 6)
    other = rotary.KVCache(spec16(layout="interleaved"), batch=1, kv_heads=H, head_dim=D, capacity=8,
                           dtype=np.float64)
    other.append(doc[None, :4], doc[None, :4])
    snap = state(cache)
    for bad, error, match in (
            (lambda: cache.insert(0, chunk, at_position=3), ValueError, "at_position = 3, but sequence 0 holds 6"),
            (lambda: cache.insert(0, other.export(0)), ValueError, "another spec"),
            (lambda: cache.insert(0, chunk.keys), TypeError, "needs values= and from_position="),
            (lambda: cache.insert(0, chunk.keys[:, :1], chunk.values, from_position=0), ValueError, "must be"),
            (lambda: cache.insert(0, np.zeros((11, H, D)), np.zeros((11, H, D)), from_position=0), KVCacheFullError,
             "past the cache's capacity of 16"),
            (lambda: cache.export(0, 4, 9), ValueError, "start, stop")):
        with pytest.raises(error, match=match):
            bad()
        assert_state(cache, snap)
    dyn = rotary.KVCache(spec16(scaling=dict(rope_type="dynamic", factor=2.0), max_position_embeddings=8), batch=1,
                         kv_heads=H, head_dim=D, capacity=16, dtype=np.float64)
    dyn.append(doc[None], doc[None])
    with pytest.raises(ValueError, match="depend on the sequence length"):
        dyn.insert(0, dyn.export(0))


# -- sliding-window caches -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_window_cache_gives_pages_back_and_attends_as_a_full_cache(backend, rng):
    W = 5
    win = paged(backend, window=W, num_pages=8, batch=2)
    full = paged(backend, num_pages=16, batch=2)
    k = tokens(rng, 9)
    for cache in (win, full):
        cache.append(np.stack([k, k]), np.stack([k, -k]))
    for step in range(14):
        kd = rng.standard_normal((2, 1, H, D)).astype(np.float32)
        q = rng.standard_normal((2, 1, 4, D)).astype(np.float32)
        outs = []
        for cache in (win, full):
            cache.append(kd, kd)
            outs.append(rotary.attention(q, cache, **({} if cache is win else dict(window=W))))
        np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6)
        held = np.count_nonzero(win.block_table[0] >= 0)
        assert held <= -(-W // 4) + 1   # the pages of the window only
    assert win.held_from(0) > 0 and win.keys(0).shape[0] == int(win.lengths[0]) - win.held_from(0)
    q = rng.standard_normal((2, 3, 4, D)).astype(np.float32)
    with pytest.raises(ValueError, match="may only narrow it"):
        rotary.attention(q, win, window=W + 1)
    for bad in (0, 2.5, True, -3):
        with pytest.raises(ValueError, match="window must be a positive int"):
            paged(window=bad)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_window_cache_refuses_reading_pages_it_gave_back(backend, rng):
    """A window cache gives back the pages before its queries' windows: a truncate whose next token would read such
    a key, or an attend with more queries than the window's pages cover, is refused by name, the cache bit for bit
    unchanged (the kernels would read through a -1 page); a truncate within the held window works and the next
    step's attention equals a full cache's."""
    if backend == "numba" and not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    W = 5
    win = paged(backend, window=W, num_pages=8, batch=1)
    full = paged(backend, num_pages=16, batch=1)
    k = tokens(rng, 9)
    for cache in (win, full):
        cache.append(k[None], k[None])
    for _ in range(8):
        kd = rng.standard_normal((1, 1, H, D)).astype(np.float32)
        for cache in (win, full):
            cache.append(kd, kd)
    length, first = int(win.lengths[0]), win.held_from(0)
    assert first > 0   # pages were given back
    before = state(win)
    with pytest.raises(ValueError, match="truncate .* gave their page back"):
        win.truncate(0, first - 1)   # the next token's window reaches before the held keys
    q = rng.standard_normal((1, length - first + 2, 4, D)).astype(np.float32)
    with pytest.raises(ValueError, match="attend: .* gave their page back"):
        rotary.attention(q, win)   # the earliest queries' windows reach keys no longer held
    after = state(win)
    for a, b in zip(before[:4], after[:4]):
        np.testing.assert_array_equal(a, b)
    back = first + W - 1   # the shortest length whose next token's window is held
    assert back < length
    win.truncate(0, back)
    full.truncate(0, back)
    kd = rng.standard_normal((1, 1, H, D)).astype(np.float32)
    q = rng.standard_normal((1, 1, 4, D)).astype(np.float32)
    outs = []
    for cache in (win, full):
        cache.append(kd, kd)
        outs.append(rotary.attention(q, cache, **({} if cache is win else dict(window=W))))
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-6)


# -- copies of an engine's cache -----------------------------------------------------------------------------------
def test_copies_keep_shared_pages_and_prefix(rng):
    cache = paged(layers=2)
    prompt = list(range(9))
    k = tokens(rng, 9)
    a = cache.add(tokens=prompt)
    for i in range(2):
        cache.append(k[None], k[None], seq_ids=[a], layer=i)
    cache.fork(a)
    for clone in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert_state(clone, state(cache))
        assert clone.lengths[clone.add(tokens=prompt)] == 8
        clone.free(clone.active)
        assert clone.free_pages == cache.num_pages
        assert cache.active.tolist() == [0, 1]


def test_fits_and_cancel_step_for_engines_with_several_caches(rng):
    """An engine checks every cache before it reserves any (fits), and can undo a reservation (cancel_step): the
    cache bit for bit as before the step."""
    glob = paged(num_pages=8, batch=2)
    slid = paged(num_pages=2, batch=2, window=4)
    for c in (glob, slid):
        c.add()
    assert glob.fits([0], [12]) and not slid.fits([0], [12])
    snap = state(glob)
    glob.reserve([0], [12])
    with pytest.raises(KVCacheFullError):
        slid.reserve([0], [12])
    glob.cancel_step()
    lengths, table, free, active, pools = snap
    assert_state(glob, (lengths, table, free, active, [None] * 4))   # (the pool may stay grown)
    for a, b in zip(glob._pools, pools):
        if b is not None:
            np.testing.assert_array_equal(a[:, :b.shape[1]].view(np.uint8), b.view(np.uint8))
    k = tokens(rng, 5)
    glob.append(k[None], k[None], seq_ids=[0])   # the cache works on
    np.testing.assert_allclose(glob.keys(0), oracle_keys(k, np.arange(5)), atol=2e-6)
    prompt = list(range(9))
    a = glob.add(tokens=prompt)
    glob.reserve([a], [9])
    glob.cancel_step()   # the prompt's pages were never written: not kept for later requests
    glob.free([a])
    assert glob._book.kept() == 0 and glob.lengths[glob.add(tokens=prompt)] == 0


def test_truncating_two_sequences_that_share_pages_counts_each_holder(rng):
    cache = paged(num_pages=8, batch=3)
    base = cache.free_pages
    k = tokens(rng, 12)
    cache.append(k[None], k[None], seq_ids=[0])
    cache.fork(0)
    cache.truncate([0, 1], [3, 3])   # both let go of pages 2 and 3 of the shared prefix
    assert cache.free_pages == base - 1 and cache._book.counts.max() == 2
    cache.free([0, 1])
    assert cache.free_pages == base and cache._book.counts.max() == 0
    assert len(cache._book.free_list) == len(set(cache._book.free_list))


# -- the prepared calls of a step ----------------------------------------------------------------------------------
def attention_oracle(cache, layer, q, **options):
    """float64 attention of dense q (n, s, Hq, D) (every sequence's last s queries, at its last positions) over layer
    ``layer``'s stored keys: q rotated by the float64 oracle, then rotary.testing.paged_attention64."""
    from rotary.testing import paged_attention64

    lens = cache.lengths.copy()
    n, s = q.shape[:2]
    qp = np.asarray(q, np.float64).reshape(n * s, *q.shape[2:])
    q_rot = oracle_keys(qp, (lens[:, None] - s + np.arange(s)).reshape(-1))
    stores = (cache.k_pool[layer].reshape(-1, H, D), cache.v_pool[layer].reshape(-1, H, D), None, None)
    o = paged_attention64(q_rot, stores, cache.block_table, cache.page_size, lens, np.arange(0, n * s + 1, s),
                          scale=options.pop("scale", D ** -0.5), **options)
    return o.reshape(q.shape)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_prepared_calls_follow_every_change_of_the_tables(backend, rng):
    """The append and attention a step's first layer prepares, and the other layers run, follow every change: a new
    step, truncate, free + fork, other options (softcap, window, scale) and other q strides; each layer's attention
    against the float64 oracle."""
    L, B = 3, 4
    cache = paged(backend, layers=L, batch=B, num_pages=48)
    cu = np.array([0, 5, 6, 13, 15])
    for i in range(L):
        k = tokens(rng, 15)
        cache.append(k, k * 0.5, cu_seqlens=cu, layer=i)

    def check_all(q, **options):
        for i in range(L):
            o = cache.layer(i).attend(q, **options)
            np.testing.assert_allclose(o, attention_oracle(cache, i, q, **options), atol=2e-5, rtol=0)

    q = rng.standard_normal((B, 1, 2 * H, D)).astype(np.float32)
    for _ in range(3):   # decode steps: layer i appends, then attends (layers 1, 2 run layer 0's prepared calls)
        kd = rng.standard_normal((B, 1, H, D)).astype(np.float32)
        for i in range(L):
            cache.layer(i).append(kd * (i + 1), kd)
            o = cache.layer(i).attend(q)
            np.testing.assert_allclose(o, attention_oracle(cache, i, q), atol=2e-5, rtol=0)
    check_all(q)
    cache.truncate([1, 2], [3, 4])
    check_all(q)
    cache.free([3])
    assert cache.fork(0, 3, length=5) == 3
    check_all(q)
    check_all(q, softcap=2.0)
    check_all(q, window=3)
    check_all(q, scale=0.3)
    wide = rng.standard_normal((B, 1, 4 * H, D)).astype(np.float32)
    check_all(wide[:, :, ::2])   # other strides
    for i in range(L):   # a step whose layers pass k of other strides: each its own prepared append
        kd = rng.standard_normal((B, 1, 2 * H, D)).astype(np.float32)
        cache.append(kd[:, :, ::2] if i == 1 else np.ascontiguousarray(kd[:, :, ::2]), kd[:, :, :H], layer=i)
        np.testing.assert_allclose(cache.layer(i).keys(0)[-1], oracle_keys(kd[0, :, ::2], [cache.lengths[0] - 1])[0],
                                   atol=2e-6)
    check_all(q)


class Shadow:
    """What a layered cache should hold: each sequence's raw keys and values per layer, at positions 0, 1, ..."""

    def __init__(self, layers, batch):
        self.k = [[[] for _ in range(batch)] for _ in range(layers)]
        self.v = [[[] for _ in range(batch)] for _ in range(layers)]

    def edit(self, fn):
        for side in (self.k, self.v):
            for rows in side:
                for b in range(len(rows)):
                    rows[b] = fn(b, rows[b])

    def check(self, cache):
        """Every sequence's keys and values against the float64 oracle, and each page's holder count."""
        for i, rows in enumerate(self.k):
            for b in range(cache.batch):
                lo, n = cache.held_from(b), int(cache.lengths[b])
                assert len(rows[b]) == n
                if n > lo:
                    np.testing.assert_allclose(cache.keys(b, layer=i), oracle_keys(np.stack(rows[b][lo:]),
                                               np.arange(lo, n)), atol=3e-6, rtol=0)
                    np.testing.assert_array_equal(cache.values(b, layer=i), np.stack(self.v[i][b][lo:]))
        if cache.paged:
            table = cache.block_table
            holders = np.bincount(table[table >= 0], minlength=cache.num_pages)
            for page in cache._book.prefix.values():
                holders[page] += 1
            np.testing.assert_array_equal(cache._book.counts, holders)


def decode_steps(cache, shadow, rng, steps, q_heads=2 * H):
    """Decode steps of every sequence (layer by layer: append, then attend against the float64 oracle)."""
    window = {} if cache.window is None else dict(window=cache.window)
    for _ in range(steps):
        q = rng.standard_normal((cache.batch, 1, q_heads, D)).astype(np.float32)
        for i in range(cache.layers):
            k = rng.standard_normal((cache.batch, 1, H, D)).astype(np.float32)
            v = rng.standard_normal((cache.batch, 1, H, D)).astype(np.float32)
            cache.layer(i).append(k, v)
            for b in range(cache.batch):
                shadow.k[i][b].append(k[b, 0])
                shadow.v[i][b].append(v[b, 0])
            np.testing.assert_allclose(cache.layer(i).attend(q), attention_oracle(cache, i, q, **window), atol=2e-5,
                                       rtol=0)
        shadow.check(cache)
    if cache.window is None:   # two queries each: not the decode step's rotation (a window cache has given back
        two = rng.standard_normal((cache.batch, 2, q_heads, D)).astype(np.float32)   # the earlier query's keys)
        np.testing.assert_allclose(cache.layer(0).attend(two), attention_oracle(cache, 0, two), atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("kind", ["paged", "window", "contiguous"])
def test_decode_steps_follow_every_change_between_them(kind, L, backend, rng, monkeypatch):
    """Decode steps of every sequence run as a chain (each step's slots from the last one's, pages taken as they
    fill, the queries' rotation from the step's keys, layer 0's prepared append moved one slot on where the backend's
    can be) between changes of the tables; after truncate, free, fork (copy on write), add, reserve + cancel_step,
    slide, the pool's growth and a refused step, each step's keys, values and attention equal the float64 oracle's,
    and every page's holder count is true."""
    B = 4
    if kind == "contiguous":
        cache = rotary.KVCache(spec16(), batch=B, kv_heads=H, head_dim=D, capacity=40, layers=L, backend=backend)
    else:
        cache = paged(backend, layers=L, batch=B, num_pages=64, **({"window": 6} if kind == "window" else {}))
    moved = []
    if backend == "numba":   # the chain's appends are moved runs, not prepared anew (counted)
        from rotary.backends import numba_kv

        def counted(run, *args):
            out = original(run, *args)
            moved.append(out is not None)
            return out

        original = numba_kv.PreparedAppend.moved
        monkeypatch.setattr(numba_kv.PreparedAppend, "moved", counted)
    shadow = Shadow(L, B)
    cu = np.array([0, 5, 6, 13, 15])
    for i in range(L):
        k, v = tokens(rng, 15), tokens(rng, 15)
        cache.append(k, v, cu_seqlens=cu, layer=i)
        for b in range(B):
            shadow.k[i][b] += list(k[cu[b]:cu[b + 1]])
            shadow.v[i][b] += list(v[cu[b]:cu[b + 1]])
    decode_steps(cache, shadow, rng, 9)   # every residue of page_size 4; the pool grows
    if kind != "window":   # (a window cache has given back the pages before its window)
        cache.truncate([1, 2], [3, 5])
        shadow.edit(lambda b, r: r[:{1: 3, 2: 5}.get(b, len(r))])
        decode_steps(cache, shadow, rng, 3)
        cache.free([3])
        assert cache.fork(0, 3, length=5) == 3   # shares a partial page: copied on write by the next step
        shadow.edit(lambda b, r: r[:5] if b == 3 else r)
        for side in (shadow.k, shadow.v):
            for rows in side:
                rows[3] = rows[0][:5]
        decode_steps(cache, shadow, rng, 5)
    cache.free([2])
    assert cache.add() == 2
    shadow.edit(lambda b, r: [] if b == 2 else r)
    decode_steps(cache, shadow, rng, 2)
    cache.reserve()
    cache.cancel_step()
    decode_steps(cache, shadow, rng, 2)
    if kind == "paged":
        cache.slide(sinks=1, window=4, seq_ids=[1])   # (0 and 3 share pages: not slid)
        shadow.edit(lambda b, r: r if b != 1 or len(r) <= 5 else r[:1] + r[-4:])
        decode_steps(cache, shadow, rng, 3)
    if kind == "contiguous":   # a step past the capacity is refused, the cache unchanged; the chain goes on after
        cache.truncate([0, 1, 2], [1, 1, 1])
        shadow.edit(lambda b, r: r if b == 3 else r[:1])
        decode_steps(cache, shadow, rng, 40 - int(cache.lengths.max()))
        snap = state(cache)
        with pytest.raises(KVCacheFullError):
            cache.append(tokens(rng, B)[:, None], tokens(rng, B)[:, None], layer=0)
        assert_state(cache, snap)
        cache.truncate([3], [30])
        shadow.edit(lambda b, r: r[:30] if b == 3 else r)
        decode_steps(cache, shadow, rng, 2)
    if backend == "numba":
        assert sum(moved) >= 5, moved   # (0 without the chain's moved appends)


def test_lengths_and_block_table_are_read_only_views(rng):
    """lengths and block_table follow the cache but cannot be written (truncate and fork change them, keeping the
    pages' holder counts and the prepared calls true)."""
    cache = paged()
    k = tokens(rng, 6)
    cache.append(k[None], k[None], seq_ids=[1])
    lengths, table = cache.lengths, cache.block_table
    with pytest.raises(ValueError, match="read-only"):
        lengths[1] = 2
    with pytest.raises(ValueError, match="read-only"):
        table[1, 0] = 3
    cache.truncate([1], [2])
    assert lengths[1] == 2 and table[1, 1] == -1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_dropped_cache_frees_its_pools(backend, rng):
    """Nothing outside a cache keeps its pools (no module-level memo of prepared stores or flat views): once the cache
    is dropped, its buffer goes."""
    import gc
    import weakref

    cache = paged(backend, layers=2)
    k = rng.standard_normal((4, 3, H, D)).astype(np.float32)
    q = rng.standard_normal((4, 1, 2 * H, D)).astype(np.float32)
    for i in range(2):
        cache.layer(i).append(k, k)
        cache.layer(i).attend(q)
    rotary.kv_append(k[:, 0], k[:, 0], cache.k_pool[0], cache.v_pool[0], np.arange(4) * 4 + 3, np.arange(4),
                     spec=cache.spec, backend=backend)
    buffer = cache.k_pool.base if cache.k_pool.base is not None else cache.k_pool
    gone = weakref.ref(buffer)
    del cache, buffer
    gc.collect()
    assert gone() is None

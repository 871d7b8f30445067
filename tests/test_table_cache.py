"""The cos/sin table cache: bounded by bytes, windows for positions far from 0, exact everywhere."""

import os
import subprocess
import sys

import numpy as np
import pytest

import rotary
from rotary.spec import tables as _tables
from rotary import testing as T

from .conftest import backend_params


@pytest.fixture
def fresh_cache():
    rotary.clear_cache()
    previous = rotary.set_table_cache_limit(256 * 2**20)
    yield
    rotary.set_table_cache_limit(previous)
    rotary.clear_cache()


def _oracle(x, positions, spec):
    return T.rope_complex(x, np.asarray(positions), spec.inv_freq(), layout=spec.layout)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("offset", [131_072, 200_003, 2**40 + 17])
def test_far_positions_are_exact_and_cached(fresh_cache, backend, offset, rng):
    """A prefill chunk at a large offset: the first call builds a window, the next ones reuse it."""
    spec = rotary.RopeSpec(64, base=5e5)
    x = rng.standard_normal((2, 300, 4, 64))
    positions = offset + np.arange(300)
    y = rotary.apply(x, positions, spec=spec, seq_axis=1, backend=backend)
    T.assert_close(y, _oracle(np.moveaxis(x, 1, -2), positions, spec).swapaxes(1, 2), like=x)
    made = rotary.table_cache_info()["misses"]
    for _ in range(3):
        np.testing.assert_array_equal(rotary.apply(x, positions, spec=spec, seq_axis=1, backend=backend), y)
    assert rotary.table_cache_info()["misses"] == made


def test_lone_far_call_builds_a_small_table(fresh_cache, rng):
    """One token at 131071 builds a window of 512 rows, not a dense table of 131072 rows (64 MiB)."""
    x = rng.standard_normal((1, 128)).astype(np.float32)
    y = rotary.apply(x, 131_071, seq_axis=-2)
    T.assert_close(y, _oracle(x, [131_071], rotary.RopeSpec(128)), like=x)
    info = rotary.table_cache_info()
    assert info["entries"] == 1 and info["bytes"] == 2 * 512 * 64 * 4, info


@pytest.mark.parametrize("backend", backend_params())
def test_decoding_past_the_dense_table(fresh_cache, backend, rng):
    """A decode loop crossing window boundaries stays exact and makes a table per 256 steps, not per step."""
    spec = rotary.RopeSpec(32)
    x = rng.standard_normal((1, 1, 32))
    start = 300_000 - 5
    for step in range(600):
        p = start + step
        T.assert_close(rotary.apply(x, p, spec=spec, backend=backend, seq_axis=-2), _oracle(x, [p], spec), like=x)
    assert rotary.table_cache_info()["misses"] <= 4


def test_decoding_walks_the_dense_table_past_its_first_rows(fresh_cache, rng):
    """A decode stream from 4000 to 9000 doubles the dense table as it walks past its end (4096 rows, then 8192,
    16384: three tables made, rows = positions, the prepared callers' table), instead of a window every 256 steps; a
    lone position past twice the table's rows leaves it as it is (a window)."""
    spec = rotary.RopeSpec(32)
    x = rng.standard_normal((1, 32))
    for p in range(4000, 9001):
        y = rotary.apply(x, p, spec=spec, seq_axis=-2)
        if p % 500 == 0:
            T.assert_close(y, _oracle(x, [p], spec), like=x)
    def dense_rows():
        return [_tables.cached_dense(key)[0] for key in list(_tables._cache) if len(key) == 3]   # (dense keys)

    assert rotary.table_cache_info()["misses"] == 3 and dense_rows() == [16384]
    T.assert_close(rotary.apply(x, 40_000, spec=spec, seq_axis=-2), _oracle(x, [40_000], spec), like=x)
    assert rotary.table_cache_info()["misses"] == 4 and dense_rows() == [16384]


def test_batch_decode_mixed_positions_share_a_window(fresh_cache, rng):
    """32 sequences decoding at positions spread over 5000 near 200 000: one window for all of them."""
    spec = rotary.RopeSpec(64)
    x = rng.standard_normal((32, 1, 64))
    for step in range(3):
        positions = (200_000 + np.arange(32) * 150 + step)[:, None]
        y = rotary.apply(x, positions, spec=spec, seq_axis=-2)
        T.assert_close(y, np.stack([_oracle(x[b], positions[b], spec) for b in range(32)]), like=x)
    assert rotary.table_cache_info()["misses"] == 1


def test_cache_is_bounded_by_bytes(fresh_cache, rng):
    x = rng.standard_normal((64, 64)).astype(np.float32)
    rotary.set_table_cache_limit(2**20)
    for i in range(40):
        spec = rotary.RopeSpec(64, base=1e4 + i)
        T.assert_close(rotary.apply(x, 1000, spec=spec, seq_axis=-2), _oracle(x, 1000 + np.arange(64), spec), like=x)
        assert rotary.table_cache_info()["bytes"] <= 2**20
    # the least recently used went first: the last spec's table is still there
    info = rotary.table_cache_info()
    rotary.apply(x, 1000, spec=rotary.RopeSpec(64, base=1e4 + 39), seq_axis=-2)
    assert rotary.table_cache_info()["misses"] == info["misses"]


def test_limit_zero_keeps_nothing_and_stays_exact(fresh_cache, rng):
    rotary.set_table_cache_limit(0)
    x = rng.standard_normal((5, 16))
    for p in (0, 7, 100_000):
        T.assert_close(rotary.apply(x, p, seq_axis=-2), _oracle(x, p + np.arange(5), rotary.RopeSpec(16)), like=x)
    assert rotary.table_cache_info()["entries"] == 0 and rotary.table_cache_info()["bytes"] == 0


def test_lowering_the_limit_evicts_now(fresh_cache, rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    for i in range(4):
        rotary.apply(x, 5000 * i, spec=rotary.RopeSpec(64, base=100.0 + i), seq_axis=-2)
    assert rotary.table_cache_info()["entries"] >= 4
    previous = rotary.set_table_cache_limit(0)
    assert previous == 256 * 2**20 and rotary.table_cache_info()["bytes"] == 0


def test_multi_axis_sub_tables_count_in_the_budget(fresh_cache, rng):
    spec = rotary.RopeSpec(64, mrope_section=(8, 12, 12))
    x = rng.standard_normal((1, 10, 64))
    pos = np.stack([np.arange(10), np.arange(10) % 3, np.arange(10) // 3], axis=-1)[None]
    rotary.apply(x, pos, spec=spec, seq_axis=-2)
    info = rotary.table_cache_info()
    assert info["bytes"] == sum(nbytes for _, nbytes in _tables._cache.values()) and info["entries"] >= 2


@pytest.mark.parametrize("value, message", [("12345", None), ("-1", "ROTARY_TABLE_CACHE_BYTES"),
                                            ("lots", "ROTARY_TABLE_CACHE_BYTES")])
def test_limit_from_the_environment(value, message):
    code = "import rotary, numpy as np; rotary.apply(np.ones((2, 8)), 3); print(rotary.table_cache_info()['limit'])"
    env = {**os.environ, "ROTARY_TABLE_CACHE_BYTES": value}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if message is None:
        assert run.returncode == 0 and run.stdout.strip() == value, run.stderr
    else:
        assert run.returncode != 0 and message in run.stderr and value in run.stderr


def test_a_table_read_by_prepared_calls_stays_recently_used(fresh_cache, rng):
    """apply_qk's prepared path reads the dense table without lookup (cached_dense): those reads mark it
    recently used, so tables of other specs filling the cache evict each other, not the hot one."""
    pytest.importorskip("numba")
    hot = rotary.RopeSpec(64)
    q, k = rng.standard_normal((1, 64, 4, 64)).astype(np.float32), rng.standard_normal((1, 64, 2, 64)).astype(np.float32)
    others = [rotary.RopeSpec(64, base=b) for b in (5e4, 6e4, 7e4)]
    x = rng.standard_normal((1, 64, 64)).astype(np.float32)

    def hot_call():
        return rotary.apply_qk(q, k, spec=hot, seq_axis=1, backend="numba")

    first = hot_call()
    one_table = rotary.table_cache_info()["bytes"]
    rotary.set_table_cache_limit(2 * one_table)   # room for two tables of this size
    (hot_key,) = _tables._cache   # the one table so far: the hot dense table
    assert _tables.cached_dense(hot_key) is not None
    for other in others:
        made = rotary.table_cache_info()["misses"]
        rotary.apply(x, np.arange(64), spec=other, seq_axis=-2)   # a table of another spec (same size)
        for _ in range(2):
            got = hot_call()                          # prepared calls: cached_dense, not lookup
        # one table made (the other spec's); an evicted hot table would have been made again
        assert rotary.table_cache_info()["misses"] == made + 1
        assert _tables.cached_dense(hot_key) is not None
        np.testing.assert_array_equal(got[0], first[0])
    assert rotary.table_cache_info()["entries"] == 2


def test_equal_specs_share_a_table_and_other_specs_do_not(fresh_cache):
    """The table cache keys a spec by a number (an int hashes in C): equal specs, built apart, read one table; specs
    that differ in anything (here only the scaling rule's factor, or only the rotary dim) never share one."""
    a, b = rotary.RopeSpec(64, base=1e4), rotary.RopeSpec(64, base=1e4)
    assert a is not b and a == b
    assert _tables.dense_key(a, np.float32) == _tables.dense_key(b, np.float32)
    others = [rotary.RopeSpec(64, base=1e4, scaling={"rope_type": "linear", "factor": 2.0}),
              rotary.RopeSpec(64, base=1e4, scaling={"rope_type": "linear", "factor": 4.0}),
              rotary.RopeSpec(32, base=1e4)]
    keys = {_tables.dense_key(s, np.float32) for s in [a] + others}
    assert len(keys) == 4
    positions = np.arange(40)[None]
    first = _tables.lookup(a, positions, dtype=np.float32)
    made = rotary.table_cache_info()["misses"]
    again = _tables.lookup(b, positions, dtype=np.float32)
    assert again[0] is first[0] and rotary.table_cache_info()["misses"] == made
    for s in others:
        cos, sin, rows = _tables.lookup(s, positions, dtype=np.float32)
        want = np.outer(np.arange(40), s.inv_freq())
        np.testing.assert_allclose(cos[rows.reshape(-1)], np.cos(want), atol=1e-6)


def test_spec_numbers_stay_bounded_and_never_mix_specs(fresh_cache, monkeypatch):
    """The specs' numbers are cleared at _SPEC_NUMBERS_MAX specs; numbers are never reused, so a spec numbered again
    gets new tables of its own values, and no key of another spec."""
    monkeypatch.setattr(_tables, "_SPEC_NUMBERS_MAX", 3)
    monkeypatch.setattr(_tables, "_spec_numbers", {})
    _tables._frequency_key.cache_clear()
    specs = [rotary.RopeSpec(32, base=b) for b in (1e4, 2e4, 3e4, 4e4, 5e4)]
    keys = [_tables.dense_key(s, np.float32) for s in specs]
    assert len(_tables._spec_numbers) <= 3
    assert len({k[0][0] for k in keys}) == len(specs)   # a number a spec
    positions = np.arange(20)[None]
    for s in specs:
        cos, _, rows = _tables.lookup(s, positions, dtype=np.float32)
        np.testing.assert_allclose(cos[rows.reshape(-1)], np.cos(np.outer(np.arange(20), s.inv_freq())), atol=1e-6)
    _tables._frequency_key.cache_clear()

"""The CUDA kernels on the host shim under AddressSanitizer + UBSan and ThreadSanitizer (no GPU needed).

Each sanitized run is a child Python with the sanitizer runtime preloaded (tests/cuda_shim/sanitize.py): the
conformance cases, a set of direct launches, random problems, random KV-cache appends and paged attention
(``kvcache``: with and without the per-head RMSNorm before RoPE, kv_append<..., true> and paged_attention's q norm,
against the reference and float64 oracles) and linear attention's backward (linear_backward.cu's two kernels;
scratch filled with NaN) run with every global buffer in an allocation of exactly its extent (``guard``: an
out-of-bounds access trips ASan), every launch twice under two shared-memory poisons (``compare``: a read of shared
memory no thread wrote changes the output), blocks on concurrent thread sets (``slots``: TSan sees races between
blocks as well as within one), and every __syncthreads checked to be reached by all threads of its block. The
planted bugs of tests/cuda_shim/planted.cu show that each check fires. Bounded to about two minutes (two sanitized
builds of the shim, then a few seconds per run); skipped with the reason when a runtime is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from .cuda_shim import host, sanitize

pytestmark = pytest.mark.sanitizer


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if host.compiler() is None:
        pytest.skip("no host C++ compiler (g++/clang++) to build the CUDA sources with the shim")
    return tmp_path_factory.mktemp("cuda_sanitize")


@pytest.fixture(scope="module")
def sanitized(build_dir):
    """mode -> build directory holding that mode's library (built here, loaded only by the children)."""
    from concurrent.futures import ThreadPoolExecutor

    modes = [mode for mode in sanitize.RUNTIMES if sanitize.missing(mode) is None]
    with ThreadPoolExecutor(len(modes) or 1) as pool:   # the two compiles side by side
        list(pool.map(lambda mode: host.build(build_dir, sanitize=mode, planted=True, load=False), modes))
    return {mode: str(build_dir) for mode in modes}


def _need(sanitized, mode):
    if mode not in sanitized:
        pytest.skip(sanitize.missing(mode))
    return sanitized[mode]


def _run(sanitized, mode, what, **kw):
    proc = sanitize.run(mode, what, directory=_need(sanitized, mode), timeout=300, **kw)
    log = proc.stdout + proc.stderr
    if proc.returncode and any(text in log for text in sanitize.CANNOT_START):
        pytest.skip(f"the {mode} sanitizer runtime cannot start on this machine: {log.strip()[-300:]}")
    return proc, log


# -- the kernels are clean --------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["conformance", "direct", "random", "kvcache", "linear_backward"])
def test_kernels_clean_under_address_and_undefined_sanitizers(sanitized, what):
    proc, log = _run(sanitized, "address", what, guard=True, compare=True, slots=1)
    assert proc.returncode == 0, log[-6000:]
    assert "OK" in proc.stdout and "ERROR: AddressSanitizer" not in log and "runtime error" not in log


@pytest.mark.parametrize("what", ["conformance", "direct", "random", "kvcache", "linear_backward"])
def test_kernels_clean_under_thread_sanitizer(sanitized, what):
    proc, log = _run(sanitized, "thread", what, compare=True, slots=3)
    assert proc.returncode == 0, log[-6000:]
    assert "OK" in proc.stdout and "ThreadSanitizer" not in log


# -- each check catches its planted bug -------------------------------------------------------------
PLANTED = {
    # name: (mode, run options, what the log must say)
    "planted_race": ("thread", {}, ["ThreadSanitizer: data race", "planted.cu:12", "planted.cu:13"]),
    "planted_block_race": ("thread", {"slots": 2}, ["ThreadSanitizer: data race", "planted_block_race"]),
    "planted_oob_read": ("address", {"guard": True}, ["heap-buffer-overflow", "planted_oob_read"]),
    "rope_short_table": ("address", {"guard": True}, ["heap-buffer-overflow", "rope_rotate"]),
    "planted_int_overflow": ("address", {}, ["signed integer overflow", "planted.cu"]),
    "planted_unwritten_shared": ("address", {"compare": True}, ["depends on the shared-memory poison"]),
    "planted_divergent_barrier": ("thread", {}, ["divergent barrier", "planted.cu:37", "the end of the block"]),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_bug_is_caught(sanitized, name):
    mode, options, expected = PLANTED[name]
    proc, log = _run(sanitized, mode, f"planted:{name}", **options)
    assert proc.returncode != 0, f"{name} ran clean under {mode} {options}:\n{log[-3000:]}"
    for text in expected:
        assert text in log, f"{name}: {text!r} not in\n{log[-4000:]}"


def test_block_race_needs_concurrent_blocks(sanitized):
    """With one block slot the blocks run one after another, so the inter-block race is invisible:
    the conformance runs under TSan use three slots."""
    proc, log = _run(sanitized, "thread", "planted:planted_block_race", slots=1)
    assert proc.returncode == 0, log[-3000:]


# -- the shim's own checks without a sanitizer runtime ------------------------------------------------
@pytest.fixture(scope="module")
def plain(build_dir):
    return host.build(build_dir, planted=True)


def _planted_plan(name, grid, block, smem, *args):
    from rotary.backends.cupy import Launch

    return Launch("planted", name, grid, block, smem, args)


def test_divergent_barrier_is_an_error_not_a_hang(plain):
    out = np.zeros(8, np.float32)
    with pytest.raises(RuntimeError, match="divergent barrier"):
        plain.launch(_planted_plan("planted_divergent_barrier", 1, 8, 0, out, np.int32(8)))


def test_two_poison_compare_sees_unwritten_shared_reads(plain):
    x, out = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    plan = _planted_plan("planted_unwritten_shared", 1, 8, 36, x, out, np.int32(8))
    plain.compare = False
    plain.launch(plan)              # without the compare it runs, and thread 7 returns the poison
    assert np.isnan(out[7]) and np.array_equal(out[:7], x[1:])
    plain.compare = True
    try:
        with pytest.raises(RuntimeError, match="shared-memory poison"):
            plain.launch(plan)
    finally:
        plain.compare = False


def test_exact_extent_copies_share_overlapping_views(plain, rng):
    """guard=True keeps aliasing intact: in-place rotation and q/k views of one fused buffer."""
    from rotary import RopeSpec
    from rotary.backends import cupy as cb

    from .test_cuda_kernels_cpu import _oracle, _tables

    spec = RopeSpec(16)
    cos, sin = _tables(spec, np.arange(5))
    fused = rng.standard_normal((1, 5, 3, 16)).astype(np.float32)
    q, k = fused[:, :, :2], fused[:, :, 2:]
    q0, k0 = q.copy(), k.copy()
    plan = cb.plan_rotate([(q, q), (k, k)], cos, sin, np.arange(5, dtype=np.int64)[None], dtype_name="float32",
                          rotary_dim=16, layout="half", inverse=False, address=host.address, threads=8,
                          max_tokens_per_block=2)
    plain.guard, plain.compare, plain.slots = True, True, 2
    try:
        plain.launch(plan)
    finally:
        plain.guard, plain.compare, plain.slots = False, False, 1
    np.testing.assert_allclose(q, _oracle(q0, np.arange(5), spec), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(k, _oracle(k0, np.arange(5), spec), rtol=2e-6, atol=2e-6)
    assert host.extent(q) == (host.address(q), host.address(q) + (4 * 48 + 32) * 4)

"""benchmarks/bench_peers.py at tiny sizes: every installed peer agrees with rotary through the
script's own check, and the check rejects a contender that is wrong (it is reported and not timed).
No timing is asserted; torch.compile is left out (its compile alone takes tens of seconds)."""

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import rotary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    path = ROOT / "benchmarks" / "bench_peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**kw):
    base = dict(quick=True, threads=2, rounds=1, round_ms=0.5, cases="prefill,decode,linear", prefill_T=48,
                linear_T=128, skip="compile", out=None, figure="none")
    base.update(kw)
    return argparse.Namespace(**base)


def test_every_peer_agrees_at_tiny_sizes(tmp_path):
    if not rotary.available_backends()["numba"][0]:
        pytest.skip("the benchmark compares against rotary's Numba backend")
    bench = _bench()
    res = bench.main(_args())
    assert not res["rejected"], res["rejected"]
    for case in ("prefill", "decode", "linear"):
        rows = res["cases"][case]
        assert any(name.startswith("rotary") for name in rows)
        for name, row in rows.items():
            assert row["best_ms"] > 0 and row["calls_per_round"] >= 1, name
            if row["rel_error"] is not None:
                assert row["rel_error"] <= row["tolerance"], name
    assert "plain NumPy (HF's formula)" in res["cases"]["decode"]
    text = bench.report(res)
    assert "decode" in text and "x rotary" in text
    pytest.importorskip("matplotlib")
    bench.figure(res, tmp_path / "peers.png")
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_a_wrong_contender_is_rejected():
    if not rotary.available_backends()["numba"][0]:
        pytest.skip("the benchmark compares against rotary's Numba backend")
    bench = _bench()
    rng = np.random.default_rng(0)
    spec = rotary.RopeSpec(128, base=bench.BASE)
    q = rng.standard_normal((2, 1, 4, 128), dtype=np.float32)
    k = rng.standard_normal((2, 1, 2, 128), dtype=np.float32)
    pos = np.array([[10], [500]])
    want = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba")
    off_by_one = bench.Contender("positions + 1", lambda: rotary.apply_qk(q, k, pos + 1, spec=spec, seq_axis=1),
                                 family="numpy")
    fp32_angles = bench.Contender("fp32 angles", lambda: _fp32_angles(q, k, pos, spec), family="numpy",
                                  fp32_angles=True)
    broken = bench.Contender("raises", lambda: 1 / 0, family="numpy")
    assert bench.check(off_by_one, want, bench.TOL_EXACT)[0] is False
    ok, err = bench.check(fp32_angles, want, bench.tol_fp32_angles(500))
    assert ok and 0 < err, "fp32 angles are off by a little, within their tolerance"
    assert bench.check(fp32_angles, want, 1e-9)[0] is False
    assert bench.check(broken, want, 1.0) == (False, "ZeroDivisionError: division by zero")
    skipped, rejected = {}, {}
    right = bench.Contender("rotary", lambda: rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1), family="rotary")
    rows = bench.run_case("tiny", [right, off_by_one, broken], want, lambda c: bench.TOL_EXACT, 1, 1e-4, skipped,
                          rejected)
    assert set(rows) == {"rotary"} and "best_ms" in rows["rotary"]
    assert set(rejected) == {"tiny: positions + 1", "tiny: raises"}
    assert "> tolerance" in rejected["tiny: positions + 1"]


def _fp32_angles(q, k, pos, spec):
    """HF's way: angles position * inv_freq in fp32 (independent of rotary's tables)."""
    ang = pos.astype(np.float32)[..., None] * spec.inv_freq().astype(np.float32)   # (B, T, D/2)
    c, s = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    out = []
    for x in (q, k):
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out.append(np.concatenate([a * c - b * s, b * c + a * s], axis=-1))
    return tuple(out)

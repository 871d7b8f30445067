"""``python -m rotary warm``: every Numba kernel compiled into the on-disk cache, so a new process's first
calls load instead of compiling."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_AFTER = """
import numpy as np, rotary
from rotary.backends.numba_kernels import linear_attention as la, rotation
q = np.ones((1, 5, 2, 64), np.float64)
rotary.apply_qk(q, q[:, :, :1], seq_axis=1, backend="numba")
_, state = rotary.linear_attention(q, q, q, causal=True, seq_axis=1, backend="numba", return_state=True)
rotary.linear_attention(q[:, :1], q[:, :1], q[:, :1], causal=True, seq_axis=1, backend="numba", state=state,
                        positions=np.array([5]))
for f in (rotation.rotate_qk_serial, la.linear_attention_tasks, la.linear_attention_step):
    print(f.__name__, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
"""


@pytest.mark.slow
def test_warm_fills_the_cache_that_later_processes_load(tmp_path):
    """The rotation and linear-attention families in float64 (a minute; the KV cache's kernels would add ~4 more):
    a later process's calls load every kernel they reach from the cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "rotary", "warm", "--dtypes", "float64", "--kernels", "rotation",
                          "linear_attention"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "linear_attention, one-token decode step" in run.stdout and "done in" in run.stdout
    assert "KV cache" not in run.stdout   # (not asked for)
    after = subprocess.run([sys.executable, "-c", _AFTER], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert after.returncode == 0, after.stderr
    counts = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in after.stdout.split("\n") if line}
    assert set(counts) == {"rotate_qk_serial", "linear_attention_tasks", "linear_attention_step"}
    for name, (hits, misses) in counts.items():
        assert hits >= 1 and misses == 0, (name, hits, misses)


def test_warm_help_names_the_command_and_an_example():
    run = subprocess.run([sys.executable, "-m", "rotary", "warm", "--help"], env=dict(os.environ, PYTHONPATH=ROOT),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    assert "python -m rotary warm --dtypes float32" in run.stdout and "NUMBA_CACHE_DIR" in run.stdout
    assert "--refresh" in run.stdout   # recompiles the kernels after an edit to a helper they inline


def test_warm_calls_of_each_family():
    """--kernels picks families of warm_calls: each family's calls, in the order of KERNELS, and all of them by
    default."""
    from rotary.cli import warm

    labels = {family: [label for label, _ in warm.warm_calls("float32", (family,))] for family in warm.KERNELS}
    assert all(labels.values()) and all("KV cache" in label for label in labels["kv_cache"])
    assert all("linear_attention" in label for label in labels["linear_attention"])
    every = [label for label, _ in warm.warm_calls("float32")]
    assert every == labels["rotation"] + labels["linear_attention"] + labels["kv_cache"]
    run = subprocess.run([sys.executable, "-m", "rotary", "warm", "--kernels", "attention"],
                         env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "attention" in run.stderr


def test_warm_rejects_an_unknown_dtype():
    run = subprocess.run([sys.executable, "-m", "rotary", "warm", "--dtypes", "int8"],
                         env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "int8" in run.stderr

"""The Numba kernels' helpers are compiled for linking only (``numba_kernels.linking``): optimised LLVM IR that
each kernel links in, no machine code of their own; cached as IR, which a later process reloads when it
compiles a new kernel signature."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_FIRST = """
import numpy as np, rotary
from rotary.backends.numba_kernels import linear_attention as la, linking, rotation
q = np.ones((1, 6, 2, 16), np.float32)
rotary.apply_qk(q, q[:, :, :1], seq_axis=1, backend="numba")
rotary.linear_attention(q, q, q, causal=True, seq_axis=1, backend="numba")
for helper in (rotation.rotate_token, rotation.rotate_vector, la.load_features, la.store_row):
    assert helper.overloads, helper                    # compiled here (an empty cache)
    for cres in helper.overloads.values():
        assert isinstance(cres.library, linking.LinkOnlyLibrary)
        assert cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name) == 0
        assert cres.library.serialize_using_object_code()[1] == "bitcode"
for kernel in (rotation.rotate_qk_serial, la.linear_attention_tasks):
    for cres in kernel.overloads.values():
        assert not isinstance(cres.library, linking.LinkOnlyLibrary)
        assert cres.library.get_pointer_to_function(cres.fndesc.llvm_cpython_wrapper_name) != 0
print("checked")
"""

_SECOND = """
import numpy as np, rotary
from rotary.backends.numba_kernels import linear_attention as la
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(3))
decay = np.full((1, 2), 0.9)
o = rotary.linear_attention(q, k, v, causal=True, seq_axis=1, backend="numba", decay=decay)
ref = rotary.linear_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True,
                              seq_axis=1, backend="numpy", decay=decay)
print(float(np.abs(o - ref).max() / np.abs(ref).max()))
for f in (la.load_features, la.linear_attention_tasks):
    print(f.__name__, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
"""


@pytest.mark.slow
def test_a_new_kernel_signature_links_helpers_reloaded_from_the_cache(tmp_path):
    """Process 1 compiles apply_qk and causal linear attention: the helpers' libraries are link-only (no entry
    point, cached as IR), the kernels' are not. Process 2 compiles the decayed kernel, a
    new signature, linking load_features from that cache (a hit, no compile), and matches the float64 reference."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    first = subprocess.run([sys.executable, "-c", _FIRST], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0 and "checked" in first.stdout, first.stderr
    second = subprocess.run([sys.executable, "-c", _SECOND], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr
    lines = second.stdout.split("\n")
    assert float(lines[0]) < 2e-5
    counts = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in lines[1:] if line}
    assert counts["load_features"][0] >= 1 and counts["load_features"][1] == 0
    assert counts["linear_attention_tasks"][1] >= 1       # the decayed signature: compiled in this process

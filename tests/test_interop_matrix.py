"""The interop matrix in docs/interop.md is generated from the tests' interop marks; the core rows."""

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close, linear_attention_quadratic, rope_complex

from .conftest import AVAILABLE
from .test_docs import ROOT, load_script


def test_docs_table_is_generated_from_the_tests():
    matrix = load_script("docs/scripts/interop_matrix.py")
    text = (ROOT / "docs" / "interop.md").read_text(encoding="utf-8")
    assert matrix.page_with_table(text) == text, "run: python docs/scripts/interop_matrix.py --write"
    libraries = {key[0] for key in matrix.cells()}
    assert {"NumPy", "CuPy", "torch", "JAX", "array-api-strict", "Dask (NumPy chunks)", "Dask (CuPy chunks)",
            "NumPy + ml_dtypes.bfloat16"} <= libraries


@pytest.mark.interop("NumPy", "cpu", "numba, numpy", "-")
def test_numpy_rows():
    x = np.random.default_rng(0).standard_normal((3, 10, 32))
    spec = rotary.RopeSpec(32)
    for backend in [b for b in ("numba", "numpy") if b in AVAILABLE]:
        assert_close(rotary.apply(x, 4, spec=spec, backend=backend, seq_axis=-2), rope_complex(x, np.arange(10) + 4, spec.inv_freq()))


@pytest.mark.gpu
@pytest.mark.interop("CuPy", "cuda", "cupy", "-")
def test_cupy_rows():
    if "cupy" not in AVAILABLE:
        pytest.skip("needs a CUDA device and CuPy")
    import cupy

    x = np.random.default_rng(0).standard_normal((3, 10, 32)).astype(np.float32)
    spec = rotary.RopeSpec(32)
    y = rotary.apply(cupy.asarray(x), 4, spec=spec, seq_axis=-2)
    assert isinstance(y, cupy.ndarray)
    assert_close(cupy.asnumpy(y), rope_complex(x, np.arange(10) + 4, spec.inv_freq()))


@pytest.mark.interop("array-api-strict", "cpu", "reference (array API)", "-")
def test_array_api_strict_rows():
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 12, 16))
    spec = rotary.RopeSpec(16)
    y = rotary.apply(xps.asarray(x), spec=spec, seq_axis=-2)
    assert type(y) is type(xps.asarray(x))
    assert_close(np.asarray(y), rope_complex(x, np.arange(12), spec.inv_freq()))
    y2 = rotary.apply(xps.asarray(x), spec=spec, seq_axis=-2)              # a second call: the per-call table conversion
    assert_close(np.asarray(y2), rope_complex(x, np.arange(12), spec.inv_freq()))
    q, k, v = (rng.standard_normal((2, 12, 16)) for _ in range(3))
    o = rotary.linear_attention(*(xps.asarray(a) for a in (q, k, v)), causal=True, spec=spec, seq_axis=-2)
    assert_close(np.asarray(o), linear_attention_quadratic(q, k, v, np.arange(12), spec.inv_freq(), causal=True))

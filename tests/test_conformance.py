"""The cross-backend conformance suite: every case on every backend against the float64 oracle."""

import pytest

from rotary.conformance import cases as conformance
from rotary.conformance import kv_cases as kv_conformance

from .conftest import backend_params


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", conformance.cases(), ids=lambda c: c.name)
def test_case(case, backend):
    to_backend, to_host = conformance.array_converters(backend)
    result = conformance.run_case(case, backend, to_backend=to_backend, to_host=to_host)
    assert result.passed, f"{case.name} on {backend}: max error {result.max_error:.3g} (tol {result.tolerance:.1g}) {result.detail}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", conformance.linear_cases(), ids=lambda c: c.name)
def test_linear_case(case, backend):
    to_backend, to_host = conformance.array_converters(backend)
    result = conformance.run_linear_case(case, backend, to_backend=to_backend, to_host=to_host)
    assert result.passed, f"{case.name} on {backend}: error {result.max_error:.3g} (tol {result.tolerance:.1g}) {result.detail}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", kv_conformance.kv_cases(), ids=lambda c: c.name)
def test_kv_case(case, backend):
    to_backend, to_host = conformance.array_converters(backend)
    result = kv_conformance.run_kv_case(case, backend, to_backend=to_backend, to_host=to_host)
    assert result.passed, f"{case.name} on {backend}: error {result.max_error:.3g} (tol {result.tolerance:.1g}) {result.detail}"


@pytest.mark.parametrize("wrong", ["rotation", "slot"])
def test_kv_case_fails_on_a_wrong_append(monkeypatch, wrong):
    """The KV check can fail: an append that rotates one position late, or writes one slot off, is caught."""
    import numpy as np

    from rotary.backends import numpy as ref

    original = ref.append_kv

    def off(k, v, cos, sin, rows, slots, stores, **kw):
        if wrong == "rotation":
            rows = np.minimum(rows + 1, cos.shape[0] - 1)
        else:
            slots = np.where(slots > 0, slots - 1, slots)
        return original(k, v, cos, sin, rows, slots, stores, **kw)

    monkeypatch.setattr(ref, "append_kv", off)
    result = kv_conformance.run_kv_case(kv_conformance.kv_cases()[0], "numpy")
    assert not result.passed


@pytest.mark.parametrize("dropped", ["k", "q"])
def test_kv_norm_case_fails_on_a_dropped_norm(monkeypatch, dropped):
    """The q/k norm check can fail: an append (attention) that skips the norm it is given is caught."""
    from rotary.backends import numpy as ref

    name = "append_kv" if dropped == "k" else "paged_attention"
    original = getattr(ref, name)
    monkeypatch.setattr(ref, name, lambda *a, norm=None, **kw: original(*a, **kw))
    case = next(c for c in kv_conformance.kv_cases() if c.qk_norm and c.caller_tables)
    assert not kv_conformance.run_kv_case(case, "numpy").passed
    case = next(c for c in kv_conformance.kv_cases() if c.qk_norm and not c.caller_tables)
    assert not kv_conformance.run_kv_case(case, "numpy").passed


def test_kv_caller_tables_case_fails_when_the_prepared_attention_differs(monkeypatch):
    """The caller-tables cases run the attention prepared too: a prepared run off by one ulp fails the case."""
    import numpy as np

    from rotary.kvcache import prepared

    original = prepared.PreparedPagedAttention.__call__
    monkeypatch.setattr(prepared.PreparedPagedAttention, "__call__",
                        lambda self, *a, **kw: np.nextafter(original(self, *a, **kw), np.inf))
    case = next(c for c in kv_conformance.kv_cases() if c.caller_tables)
    result = kv_conformance.run_kv_case(case, "numpy")
    assert not result.passed and "prepare_paged_attention" in result.detail


def test_linear_case_fails_on_a_wrong_backend(monkeypatch):
    """The linear check can fail: a backend whose output is 1% off is caught."""
    import numpy as np

    from rotary.backends import numpy as ref

    original = ref.linear_attention

    def off_by_one_percent(q, k, v, cos, sin, rows, **kw):
        o, state = original(q, k, v, cos, sin, rows, **kw)
        return o * np.float32(1.01), state   # a 1% error anywhere is far outside the tolerance

    monkeypatch.setattr(ref, "linear_attention", off_by_one_percent)
    result = conformance.run_linear_case(conformance.linear_cases()[0], "numpy")
    assert not result.passed and result.max_error > 1e-3


def test_linear_oracle_equals_the_formula_term_by_term(rng):
    """rotary.testing.linear_attention_quadratic against an explicit double loop over t and s."""
    import numpy as np

    import rotary
    from rotary import testing

    spec = rotary.RopeSpec(6, layout="interleaved", base=50.0)
    q, k = rng.standard_normal((2, 5, 6))
    v = rng.standard_normal((5, 3))
    pos = np.array([3, 1, 4, 1, 5])
    for causal in (True, False):
        got = testing.linear_attention_quadratic(q, k, v, pos, spec.inv_freq(), layout="interleaved", causal=causal)
        a, b = testing.feature_map64(q), testing.feature_map64(k)
        for t in range(5):
            num, den = np.zeros(3), 0.0
            for s in range(5 if not causal else t + 1):
                R_t = testing.rotation_matrix(pos[t], spec.inv_freq(), 6, layout="interleaved")
                R_s = testing.rotation_matrix(pos[s], spec.inv_freq(), 6, layout="interleaved")
                num += (R_t @ a[t]) @ (R_s @ b[s]) * v[s]
                den += a[t] @ b[s]
            np.testing.assert_allclose(got[t], num / (den + 1e-6), rtol=1e-12, atol=1e-12)


def test_quick_is_a_subset_covering_both_layouts():
    quick = conformance.cases(quick=True)
    names = {c.name for c in conformance.cases()}
    assert {c.name for c in quick} <= names
    assert {c.layout for c in quick} == {"half", "interleaved"}
    quick_linear = conformance.linear_cases(quick=True)
    assert {c.name for c in quick_linear} <= {c.name for c in conformance.linear_cases()}
    assert {c.causal for c in quick_linear} == {True, False}

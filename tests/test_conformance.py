"""The cross-backend conformance suite: every case on every backend against the float64 oracle."""

import pytest

from rotary import _conformance as conformance

from .conftest import backend_params


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", conformance.cases(), ids=lambda c: c.name)
def test_case(case, backend):
    to_backend, to_host = conformance.array_converters(backend)
    result = conformance.run_case(case, backend, to_backend=to_backend, to_host=to_host)
    assert result.passed, f"{case.name} on {backend}: max error {result.max_error:.3g} (tol {result.tolerance:.1g}) {result.detail}"


def test_quick_is_a_subset_covering_both_layouts():
    quick = conformance.cases(quick=True)
    names = {c.name for c in conformance.cases()}
    assert {c.name for c in quick} <= names
    assert {c.layout for c in quick} == {"half", "interleaved"}

import numpy as np
import pytest

from rotary.backends import available_backends

AVAILABLE = [name for name, (ok, _) in available_backends().items() if ok]
ALL_BACKENDS = ["numpy", "numba", "cupy"]


def backend_params():
    """Every backend as a pytest param; unavailable ones skip with the registry's reason."""
    reasons = available_backends()
    return [pytest.param(b, marks=() if reasons[b][0] else pytest.mark.skip(reason=reasons[b][1]), id=b)
            for b in ALL_BACKENDS]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def run_in_threads(work, n_threads, timeout=240):
    """Run ``work(i)`` on threads i = 0 .. n_threads-1 at once and return what they raised (a list, empty
    when none did); each work function does its own checks."""
    import threading

    errors = []

    def guarded(i):
        try:
            work(i)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return errors


# -- hypothesis profiles (issue 25): "ci" by default (bounded, derandomized: reproducible in CI), "thorough"
# by hand: HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties*.py (20x the examples, random)
def _hypothesis_profiles():
    import os

    from hypothesis import HealthCheck, settings

    quiet = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large,
             HealthCheck.filter_too_much]
    settings.register_profile("ci", deadline=None, derandomize=True, database=None, suppress_health_check=quiet,
                              print_blob=True)
    settings.register_profile("thorough", deadline=None, suppress_health_check=quiet, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_hypothesis_profiles()


# -- test selection: `python -m pytest` runs the quick subset of tests/selection.py, `--full` everything;
# the hooks live in tests/selection.py (tests/test_suite_selection.py runs them on a small project)
from .selection import pytest_addoption, pytest_collection_modifyitems, pytest_terminal_summary  # noqa: E402,F401

import json
import os
from pathlib import Path

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


# -- test selection (tests/selection.py): `python -m pytest` runs the quick subset, `--full` everything ---
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the whole suite; without it, a plain `python -m pytest` runs the quick selection "
                          "of tests/selection.py (also on when CI=true, or when test paths, -k or -m are given)")


def _selection_is_quick(config) -> bool:
    """The quick selection applies to a plain run: no --full, no CI=true, no paths other than the
    default tests directory, no -k / -m expression."""
    from .selection import full_from_environment

    if config.getoption("--full") or full_from_environment():
        return False
    if config.getoption("keyword") or config.getoption("markexpr"):
        return False
    tests_dir = Path(__file__).resolve().parent
    return all(Path(config.invocation_params.dir, arg).resolve() == tests_dir
               for arg in config.option.file_or_dir or ())


def pytest_collection_modifyitems(config, items):
    config._rotary_collected = [(it.nodeid, tuple(m.name for m in it.iter_markers())) for it in items]
    if os.environ.get("ROTARY_COLLECTED_JSON"):     # tests/test_suite_selection.py reads what was collected
        Path(os.environ["ROTARY_COLLECTED_JSON"]).write_text(json.dumps(config._rotary_collected))
    if not _selection_is_quick(config):
        config._rotary_selection = f"full ({len(items)} tests)"
        return
    from .selection import is_quick

    keep, dropped = [], []
    for item in items:
        (keep if is_quick(item.nodeid, [m.name for m in item.iter_markers()]) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    config._rotary_selection = (f"quick ({len(keep)} of {len(keep) + len(dropped)} tests); "
                                "`python -m pytest --full` runs them all")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    selection = getattr(config, "_rotary_selection", None)
    if selection:
        terminalreporter.write_line(f"test selection: {selection}")

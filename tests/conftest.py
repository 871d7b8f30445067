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

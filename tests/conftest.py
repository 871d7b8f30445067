import numpy as np
import pytest

import rotary
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

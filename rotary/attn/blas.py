"""Single-threaded BLAS in one thread: for code that runs many small matmuls from its own threads.

OpenBLAS (>= 0.3.27, NumPy's bundled build included) has ``openblas_set_num_threads_local(n)``:
the BLAS thread count of the calling thread only. :func:`single_thread_blas` finds it in the
libraries this process has loaded (as threadpoolctl does) and returns a function that sets 1 for
the calling thread, or None when there is no such library (other BLAS, other systems): callers
then stay serial and let BLAS thread the matmuls itself.
"""

from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def single_thread_blas():
    """A no-argument function that makes the calling thread's OpenBLAS calls single-threaded, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return lambda: fn(1)
    return None

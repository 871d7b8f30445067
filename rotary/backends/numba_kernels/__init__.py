"""rotary.backends.numba_kernels."""

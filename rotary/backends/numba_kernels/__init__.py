"""Numba kernels of the ``numba`` backend, split as the CUDA ones are (``cuda_kernels/``):

- :mod:`.common` (``rotary_common.cuh``): flat buffers, int64 offsets, float16 bits, borrowed views;
- :mod:`.rotation` (``rope.cu``): the rotation of q and k;
- :mod:`.linear_attention` (``linear_attention.cu``): linear attention with RoPE, chunked and one-token;
- :mod:`.simd`: the SIMD vectors both use (their width: what Numba compiles for).

Only the kernels the backend calls are cached on disk (``cache=True``; their machine code holds every helper
they call). Numba keys a cached kernel by its signature and (triple, CPU name, CPU features) and invalidates
it when the kernel's own source file changes (modification time, size): an edit to a helper in another file of
this package (``simd.py``, ``common.py``) does not invalidate the kernels that inline it. ``python -m rotary
warm --refresh`` recompiles them (as after any such edit in a development tree).

Importing this package imports numba; only ``rotary.backends.numba`` does.
"""

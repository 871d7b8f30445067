"""Numba kernels of the ``numba`` backend, split as the CUDA ones are (``cuda_kernels/``):

- :mod:`.common` (``rotary_common.cuh``): flat buffers, int64 offsets, float16 bits, borrowed views;
- :mod:`.rotation` (``rope.cu``): the rotation of q and k;
- :mod:`.linear_attention` (``linear_attention.cu``): linear attention with RoPE, chunked and one-token;
- :mod:`.simd`: the SIMD vectors both use; :mod:`.cache`: Numba's on-disk cache keyed on all of them.

Importing this package imports numba; only ``rotary.backends.numba`` does.
"""

from . import cache as _cache

_cache.install()

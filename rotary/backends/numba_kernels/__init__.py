"""Numba kernels of the ``numba`` backend, split as the CUDA ones are (``cuda_kernels/``):

- :mod:`.common` (``rotary_common.cuh``): flat buffers, int64 offsets, float16 bits, borrowed views;
- :mod:`.rotation` (``rope.cu``): the rotation of q and k;
- :mod:`.linear_attention` (``linear_attention.cu``): linear attention with RoPE, chunked and one-token;
- :mod:`.kv_cache`: the KV cache's append (rotate k into its slots, int8 quantization) and attention over it;
- :mod:`.simd`: the SIMD vectors they use (their width: what Numba compiles for).

Only the kernels the backend calls are cached on disk (``cache=True``; their machine code holds every helper
they call). Numba keys a cached kernel by its signature and (triple, CPU name, CPU features) and invalidates
it when the kernel's own source file changes (modification time, size). The helpers they inline live in other
files (``simd.py``, ``common.py``, ``../feature_maps.py``, and ``rotation.py``'s pair rotation, which the
linear-attention and KV-cache kernels inline): :func:`refresh_after_helper_edits` (run on import)
keeps a digest of those files in ``__pycache__`` and, when it differs, marks the kernel files changed (their
modification time set to now, which Numba's documented cache rule reads), so an edited helper never runs
from a stale kernel. ``python -m rotary warm --refresh`` does the same by hand.

Importing this package imports numba; only ``rotary.backends.numba`` does.
"""

import hashlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
#: the files whose code the cached kernels inline, and the kernel files Numba stamps
HELPER_FILES = ("__init__.py", "common.py", "simd.py", "rotation.py", "linear_attention.py",
                os.path.join(os.pardir, "feature_maps.py"))
KERNEL_FILES = ("rotation.py", "linear_attention.py", "linear_backward.py", "kv_cache.py")
_STAMP = os.path.join(_HERE, "__pycache__", "rotary_kernel_helpers.sha256")


def helpers_digest() -> str:
    """sha256 of the helper files' contents (see the module docstring)."""
    digest = hashlib.sha256()
    for name in HELPER_FILES:
        with open(os.path.join(_HERE, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def mark_kernels_changed() -> None:
    """Set the kernel files' modification time to now: Numba compiles each cached kernel once more."""
    for name in KERNEL_FILES:
        os.utime(os.path.join(_HERE, name))


def refresh_after_helper_edits() -> bool:
    """Mark the kernels changed when the helpers' digest differs from the one last recorded (or none is);
    True when it did. Nothing happens where the package folder is read-only (an installed package that is
    never edited)."""
    try:
        digest = helpers_digest()
        try:
            with open(_STAMP, encoding="ascii") as f:
                if f.read().strip() == digest:
                    return False
        except FileNotFoundError:
            pass
        mark_kernels_changed()
        os.makedirs(os.path.dirname(_STAMP), exist_ok=True)
        with open(_STAMP, "w", encoding="ascii") as f:
            f.write(digest)
        return True
    except OSError:
        return False


refresh_after_helper_edits()

"""Numba's on-disk cache for the kernels, keyed on every kernel source file together.

Numba keys a cached function on its own source file's modification time and size, so an edit to a
helper in another file (``simd.py``, ``common.py``) that a kernel inlines or links would leave the
kernel's stale machine code in ``__pycache__``. :class:`KernelSetLocator` wraps the locator Numba
would pick for a function of this package and returns a source stamp of all of this package's files:
an edit to any of them invalidates every kernel's cache entry (each recompiles once).
"""

from __future__ import annotations

import os

from numba.core import caching

_DIR = os.path.dirname(os.path.abspath(__file__))
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")


def kernel_sources() -> list[str]:
    """The source files whose edits invalidate the cached kernels (every .py of this package)."""
    return sorted(os.path.join(_DIR, f) for f in os.listdir(_DIR) if f.endswith(".py"))


def sources_stamp() -> tuple:
    """(file name, mtime, size) of every kernel source file."""
    stamp = []
    for path in kernel_sources():
        st = os.stat(path)
        stamp.append((os.path.basename(path), st.st_mtime, st.st_size))
    return tuple(stamp)


class KernelSetLocator:
    """The cache locator Numba would use for a kernel of this package (``inner``), with a source stamp
    of all the package's files instead of the function's own file."""

    _inner_classes: tuple = ()

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), sources_stamp())

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.dirname(os.path.abspath(py_file)) != _DIR:
            return None
        for inner_class in cls._inner_classes:
            inner = inner_class.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner)
        return None


def install() -> None:
    """Put :class:`KernelSetLocator` first among Numba's cache locators (once)."""
    classes = _IMPL._locator_classes
    if classes and classes[0] is KernelSetLocator:
        return
    KernelSetLocator._inner_classes = tuple(classes)
    _IMPL._locator_classes = [KernelSetLocator, *classes]

"""Build the CUDA kernel sources with the host C++ compiler (C++20) and launch them through ctypes.

``build(directory)`` compiles every kernel instantiation that the CuPy backend would ask NVRTC for
(``rotary.backends.cupy.name_expressions``) into one shared library, with ``cuda_shim.h`` standing in
for the CUDA runtime. :meth:`HostKernels.launch` takes the same :class:`rotary.backends.cupy.Launch`
plans the CuPy backend launches, with NumPy arrays in place of CuPy arrays.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from rotary.backends import cupy as cuda_backend

SHIM_DIR = Path(__file__).resolve().parent
#: dtypes built on the host (float16 needs the compiler's _Float16)
DTYPES = ("float32", "float64", "float16", "bfloat16")


def compiler() -> str | None:
    """The host C++ compiler: $CXX, else g++ or clang++ on PATH."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def instantiations() -> list[tuple[str, str, str]]:
    """(family, dtype name, name expression) of every kernel the CuPy backend can launch."""
    return [(family, dtype, expr) for family in cuda_backend.SOURCES for dtype in DTYPES
            for expr in cuda_backend.name_expressions(family, dtype)]


def _translation_unit(entries) -> str:
    lines = ['#include "cuda_shim.h"']
    lines += [f'#include "{name}"' for name in cuda_backend.SOURCES.values()]
    for i, (_, _, expr) in enumerate(entries):
        lines.append(f'extern "C" void rotary_shim_kernel_{i}(unsigned grid, unsigned block, std::size_t smem, '
                     f'void** args, const std::size_t* sizes, std::size_t n) '
                     f'{{ rotary_shim::launch(&{expr}, grid, block, smem, args, sizes, n); }}')
    lines.append('extern "C" const char* rotary_shim_error() { return rotary_shim::error.c_str(); }')
    return "\n".join(lines) + "\n"


#: NumPy scalar type of a plan argument -> the ctypes type of the C++ parameter
SCALARS = {np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


class HostKernels:
    """The compiled shim library; :meth:`launch` runs a plan."""

    def __init__(self, path: Path, entries):
        self.lib = ctypes.CDLL(str(path))
        self.lib.rotary_shim_error.restype = ctypes.c_char_p
        self.index = {expr: i for i, (_, _, expr) in enumerate(entries)}

    def launch(self, plan) -> None:
        if plan is None:
            return
        fn = getattr(self.lib, f"rotary_shim_kernel_{self.index[plan.kernel]}")
        fn.restype = None
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_size_t]
        values = [ctypes.c_void_p(address(a)) if isinstance(a, np.ndarray) else SCALARS[type(a)](a)
                  for a in plan.args]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        sizes = (ctypes.c_size_t * len(values))(*[ctypes.sizeof(v) for v in values])
        fn(plan.grid, plan.block, plan.shared_mem, pointers, sizes, len(values))
        error = self.lib.rotary_shim_error().decode()
        if error:
            raise RuntimeError(f"{plan.kernel}: {error}")


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def build(directory: Path, *, cxx: str | None = None, opt: str = "-O1") -> HostKernels:
    """Compile the shim library into ``directory`` (reused when the sources are unchanged)."""
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++ or clang++) found")
    entries = instantiations()
    source = _translation_unit(entries)
    digest = hashlib.sha256(source.encode())
    for path in sorted(cuda_backend.KERNEL_DIR.glob("*.cu*")) + [SHIM_DIR / "cuda_shim.h"]:
        digest.update(path.read_bytes())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / f"rotary_shim_{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        tu = directory / "rotary_shim.cpp"
        tu.write_text(source)
        cmd = [cxx, "-std=c++20", opt, "-shared", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas",
               f"-I{SHIM_DIR}", f"-I{cuda_backend.KERNEL_DIR}", str(tu), "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"host build failed: {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    return HostKernels(lib, entries)

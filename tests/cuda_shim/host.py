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


def instantiations(families=None, dtypes=DTYPES) -> list[tuple[str, str, str]]:
    """(family, dtype name, name expression) of every kernel the CuPy backend can launch (of ``families`` and
    ``dtypes`` only, when given)."""
    return [(family, dtype, expr) for family in (families or cuda_backend.SOURCES) for dtype in dtypes
            for expr in cuda_backend.name_expressions(family, dtype)]


#: the planted bugs of tests/cuda_shim/planted.cu (each sanitizer mode must catch its own)
PLANTED = ("planted_race", "planted_oob_read", "planted_unwritten_shared", "planted_divergent_barrier",
           "planted_block_race", "planted_int_overflow", "planted_fused_rotation")

def contracting_flags() -> list[str] | None:
    """Flags that let the host compiler fuse a * b + c into an FMA (as NVRTC's default --fmad=true does on the
    device), for build(extra_flags=...); None where this machine has no FMA instructions (x86 without 'fma')."""
    import platform

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["-ffp-contract=fast"]
    if machine in ("x86_64", "amd64"):
        try:
            cpu = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
        if any(line.startswith("flags") and " fma " in f"{line} " for line in cpu.splitlines()):
            return ["-mfma", "-ffp-contract=fast"]
    return None

#: flags of every host build (besides -std and -O): -ffp-contract=off keeps a * b + c two roundings everywhere
#: (rotary_common.cuh's rn_* and rotate_pair stay unfused even without it: a build with contraction on checks that)
HOST_FLAGS = ["-shared", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-ffp-contract=off"]

#: compiler flags per sanitizer mode (None: the plain build)
SANITIZE_FLAGS = {
    None: [],
    "address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"],
    "thread": ["-fsanitize=thread", "-fno-omit-frame-pointer", "-g"],
}


def _translation_unit(entries, planted: bool = False) -> str:
    lines = ['#include "cuda_shim.h"']
    files = list(cuda_backend.SOURCES.values())
    inner = {name for f in files for name in cuda_backend.included_sources(f)}
    lines += [f'#include "{name}"' for name in files if name not in inner]   # (included ones come with their includer)
    if planted:
        lines.append('#include "planted.cu"')
    for i, (_, _, expr) in enumerate(entries):
        lines.append(f'extern "C" void rotary_shim_kernel_{i}(unsigned grid, unsigned block, std::size_t smem, '
                     f'void** args, const std::size_t* sizes, std::size_t n) '
                     f'{{ rotary_shim::launch(&{expr}, grid, block, smem, args, sizes, n); }}')
    lines.append('extern "C" const char* rotary_shim_error() { return rotary_shim::error.c_str(); }')
    return "\n".join(lines) + "\n"


#: NumPy scalar type of a plan argument -> the ctypes type of the C++ parameter
SCALARS = {np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


class HostKernels:
    """The compiled shim library; :meth:`launch` runs a plan.

    Settings (attributes, all off by default):
      * ``slots``: blocks run concurrently on that many sets of threads (ThreadSanitizer then sees races
        between blocks, as on a GPU, not only between the threads of a block);
      * ``guard``: every array argument is copied into an allocation of exactly its extent (the bytes its
        shape and strides span) for the launch and copied back after it, so an out-of-bounds global
        access leaves the allocation (AddressSanitizer reports it; arrays whose extents overlap share
        one copy, so in-place and aliased calls behave as on the original memory);
      * ``compare``: every launch runs twice, with shared memory poisoned with two different bytes
        (``POISONS``); outputs that differ mean the kernel read shared memory it had not written.
    """

    #: shared-memory fill bytes of the two runs of a compared launch: NaN in every float width, and a
    #: finite pattern (0x5A5A5A5A is about 1.5e16 in fp32)
    POISONS = (0xFF, 0x5A)

    def __init__(self, path: Path, entries, *, slots: int = 1, guard: bool = False, compare: bool = False):
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(path))
        self.lib.rotary_shim_error.restype = ctypes.c_char_p
        self.lib.rotary_shim_alloc.restype = ctypes.c_void_p
        self.lib.rotary_shim_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        self.lib.rotary_shim_free.restype = None
        self.lib.rotary_shim_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.lib.rotary_shim_configure.restype = None
        self.lib.rotary_shim_configure.argtypes = [ctypes.c_uint, ctypes.c_ubyte]
        self.entries = list(entries)
        self.index = {expr: i for i, (_, _, expr) in enumerate(self.entries)}
        self.slots, self.guard, self.compare = slots, guard, compare
        self.launches = 0

    def launch(self, plan) -> None:
        if plan is None:
            return
        self.launches += 1
        if not (self.guard or self.compare):
            self._run(plan, plan.args, self.POISONS[0])
            return
        copies = _ExactCopies(self.lib, plan.args)
        try:
            if self.compare:
                before = copies.snapshot()
                self._run(plan, copies.args, self.POISONS[0])
                first = copies.snapshot()
                copies.restore(before)
                self._run(plan, copies.args, self.POISONS[1])
                differ = [a for a, b, names in zip(first, copies.snapshot(), copies.names) if a != b]
                if differ:
                    which = [names for a, b, names in zip(first, copies.snapshot(), copies.names) if a != b]
                    raise RuntimeError(f"{plan.kernel}: output depends on the shared-memory poison (reads shared "
                                       f"memory it did not write): arguments {which}")
            else:
                self._run(plan, copies.args, self.POISONS[0])
            copies.copy_back()
        finally:
            copies.free()

    def _run(self, plan, args, poison: int) -> None:
        self.lib.rotary_shim_configure(self.slots, poison)
        fn = getattr(self.lib, f"rotary_shim_kernel_{self.index[plan.kernel]}")
        fn.restype = None
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_size_t]
        values = [ctypes.c_void_p(a) if isinstance(a, _Pointer) else
                  ctypes.c_void_p(address(a)) if isinstance(a, np.ndarray) else SCALARS[type(a)](a)
                  for a in args]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        sizes = (ctypes.c_size_t * len(values))(*[ctypes.sizeof(v) for v in values])
        fn(plan.grid, plan.block, plan.shared_mem, pointers, sizes, len(values))
        error = self.lib.rotary_shim_error().decode()
        if error:
            raise RuntimeError(f"{plan.kernel}: {error}")


class _Pointer(int):
    """A device-pointer argument that is not a NumPy array (an exact-extent copy)."""


def extent(a: np.ndarray) -> tuple[int, int]:
    """[lo, hi) byte addresses spanned by the elements of ``a`` (hi == lo when it has none)."""
    lo = hi = address(a)
    if a.size == 0:
        return lo, lo
    for n, stride in zip(a.shape, a.strides):
        span = (n - 1) * stride
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return lo, hi + a.itemsize


class _ExactCopies:
    """The array arguments of a launch, moved into allocations of exactly their (merged) extents."""

    #: intervals above this size are left in place (e.g. the lazily allocated 4 GiB views of a test)
    LIMIT = 1 << 28

    def __init__(self, lib, args):
        self.lib = lib
        spans = sorted({extent(a) for a in args if isinstance(a, np.ndarray)})
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.blocks = []   # (original lo, size, pad, copy address)
        for lo, hi in merged:
            if hi - lo > self.LIMIT:
                self.blocks.append((lo, hi - lo, 0, lo))
                continue
            pad = lo % 64
            copy = lib.rotary_shim_alloc(pad, hi - lo)
            if not copy:
                self.free()
                raise MemoryError(f"cannot allocate {hi - lo} bytes for an exact-extent copy")
            ctypes.memmove(copy, lo, hi - lo)
            self.blocks.append((lo, hi - lo, pad, copy))
        self.args, self.names = [], [[] for _ in self.blocks]
        for i, a in enumerate(args):
            if not isinstance(a, np.ndarray):
                self.args.append(a)
                continue
            lo, _ = extent(a)
            j = max(j for j, blk in enumerate(self.blocks) if blk[0] <= lo)
            self.names[j].append(i)
            self.args.append(_Pointer(self.blocks[j][3] + address(a) - self.blocks[j][0]))

    def snapshot(self) -> list[bytes]:
        return [ctypes.string_at(copy, size) for _, size, _, copy in self.blocks]

    def restore(self, saved) -> None:
        for (_, size, _, copy), data in zip(self.blocks, saved):
            ctypes.memmove(copy, data, size)

    def copy_back(self) -> None:
        for lo, size, _, copy in self.blocks:
            if copy != lo:
                ctypes.memmove(lo, copy, size)

    def free(self) -> None:
        for lo, _, pad, copy in self.blocks:
            if copy != lo:
                self.lib.rotary_shim_free(copy, pad)
        self.blocks = []


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def build(directory: Path, *, cxx: str | None = None, opt: str = "-O1", sanitize: str | None = None,
          planted: bool = False, load: bool = True, families=None, dtypes=DTYPES, extra_flags=(),
          **settings) -> HostKernels | Path:
    """Compile the shim library into ``directory`` (reused when the sources and flags are unchanged).

    ``sanitize``: None, "address" (AddressSanitizer + UBSan) or "thread" (ThreadSanitizer); a sanitized
    library loads only into a process that has the sanitizer runtime first (LD_PRELOAD, see
    tests/cuda_shim/sanitize.py). ``planted``: also build the deliberately broken kernels of planted.cu.
    ``families`` / ``dtypes``: only those instantiations (a smaller, faster build). ``extra_flags``: compiler
    flags after the usual ones (e.g. :func:`contracting_flags`). ``settings``: HostKernels' slots / guard /
    compare. ``load=False``: compile only, return the path.
    """
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no host C++ compiler (g++ or clang++) found")
    entries = instantiations(families, dtypes) + ([("planted", "-", name) for name in PLANTED] if planted else [])
    source = _translation_unit(entries, planted)
    if sanitize is not None:
        opt = "-O0"   # compiles several times faster with the sanitizers; the sanitized runs are short
    flags = ["-std=c++20", opt, *HOST_FLAGS, *SANITIZE_FLAGS[sanitize], *extra_flags]
    digest = hashlib.sha256((source + " ".join([cxx] + flags)).encode())
    for path in sorted(cuda_backend.KERNEL_DIR.glob("*.cu*")) + sorted(SHIM_DIR.glob("*.[ch]*")):
        digest.update(path.read_bytes())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / f"rotary_shim_{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        tu = directory / f"rotary_shim_{digest.hexdigest()[:16]}.{os.getpid()}.cpp"   # per process: two builds of
        tu.write_text(source)                                                           # one digest never mix
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, *flags, f"-I{SHIM_DIR}", f"-I{cuda_backend.KERNEL_DIR}", str(tu), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        tu.unlink(missing_ok=True)
        if proc.returncode:
            raise RuntimeError(f"host build failed: {' '.join(cmd)}\n{proc.stderr[-6000:]}")
        os.replace(tmp, lib)
    return HostKernels(lib, entries, **settings) if load else lib

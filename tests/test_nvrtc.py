"""Every CUDA kernel instantiation compiles with NVRTC (no GPU needed), and each .cu file with nvcc.

NVRTC comes from CuPy's bindings (``cupy_backends.cuda.libs.nvrtc``) over the NVRTC library of the
``nvidia-cuda-nvrtc-cu12`` wheel (or a CUDA toolkit); the sources are the exact text the CuPy backend
hands to ``cupy.RawModule`` (``rotary.backends.cupy.source_text``) with the same name expressions.
The ptxas run and its parser are benchmarks/cuda_resources.py's, which writes docs/cuda.md's resource tables.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rotary.backends import cupy as cb

pytestmark = pytest.mark.nvrtc

#: (NVRTC --gpu-architecture, output): cubin runs ptxas inside NVRTC; PTX checks the front end only
NVRTC_TARGETS = [("compute_70", "ptx"), ("compute_80", "ptx"), ("sm_90", "cubin")]
NVCC_ARCHS = ("sm_90",)          # the test; benchmarks/cuda_resources.py reports sm_80 and sm_90
DTYPES = tuple(cb.KERNEL_TYPES)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or the NVRTC shared library cannot be loaded
        pytest.skip(f"NVRTC unavailable ({type(exc).__name__}: {exc}); "
                    "pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")
    return nvrtc


def nvrtc_compile(family: str, names, target: str, output: str):
    """(binary, lowered names, log) of the backend's source for ``family`` with ``names`` instantiated."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(cb.source_text(family), cb.SOURCES[family], (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, (*cb.NVRTC_OPTIONS, f"--gpu-architecture={target}"))
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC failed for {family} {target}:\n{nvrtc.getProgramLog(prog)}")
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        binary = nvrtc.getCUBIN(prog) if output == "cubin" else nvrtc.getPTX(prog)
        return binary, lowered, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def ptx_entry(text: str, lowered: str) -> str:
    """The PTX of one entry function (from its .entry line to the next one)."""
    start = text.index(f".entry {lowered}(")
    end = text.find(".entry ", start + 1)
    return text[start:end if end > 0 else len(text)]


@pytest.mark.parametrize("target,output", NVRTC_TARGETS, ids=[t for t, _ in NVRTC_TARGETS])
@pytest.mark.parametrize("family", list(cb.SOURCES))
def test_every_instantiation_compiles_with_nvrtc(family, target, output):
    nvrtc = _nvrtc()
    arch = int(re.sub(r"\D", "", target))
    if arch not in nvrtc.getSupportedArchs():
        pytest.skip(f"this NVRTC ({nvrtc.getVersion()}) does not support {target}")
    names = [n for dtype in DTYPES for n in cb.name_expressions(family, dtype)]
    binary, lowered, log = nvrtc_compile(family, names, target, output)
    assert len(binary) > 0 and all(lowered.values())
    warnings = [line for line in log.splitlines() if "warning" in line and "deprecated" not in line]
    assert not warnings, log
    if output == "ptx":
        text = binary.decode() if isinstance(binary, bytes) else binary
        for low in lowered.values():
            assert f".entry {low}(" in text
        # 16-byte accesses exist where the plan allows them (vectorised fp16 rotation)
        if family == "rope":
            assert re.search(r"ld\.global\.v4\.u32|ld\.global\.v4\.b32", text)
        # one rounding contract: the pair rotations (rope_rotate, kv_append's keys) are never fused into an FMA,
        # although NVRTC fuses a * b + c by default (--fmad=true): rotary_common.cuh's rotate_pair rounds each
        # product and sum alone, so the cache's keys and rotary.apply's are NumPy's bits on the GPU too
        fused = [name for name, low in lowered.items() if name.startswith(("rope_rotate<", "kv_append<"))
                 and re.search(r"\bfma\.rn\.f(32|64)\b", ptx_entry(text, low))]
        assert not fused, f"FMAs in {fused}"
        # paged_attention stages each tile with cp.async from sm_80 on (16-byte global loads before), reads the
        # staged rows 16 bytes at a time, and keeps its accumulators in registers (no local memory)
        for name, low in lowered.items():
            if name.startswith("paged_attention<"):
                entry = ptx_entry(text, low)
                staged = "cp.async.cg.shared.global" in entry and "cp.async.wait_all" in entry
                assert staged == (arch >= 80), (name, target)
                sixteen = re.search(r"ld\.shared\.(v4\.[buf]32|v2\.[buf]64)\b", entry)
                assert sixteen and ".local" not in entry, (name, target)


def test_instantiations_cover_every_dtype_width_and_layout():
    names = cb.name_expressions("rope", "float16")
    assert len(names) == 4 * len(cb.vector_widths("float16")) == 16   # (read, write) pair layouts: 2 same, 2 mixed
    same, mixed = cb.name_expressions("rope", "float16", ""), cb.name_expressions("rope", "float16", "mixed")
    assert len(same) == len(mixed) == 8 and set(same) | set(mixed) == set(names)
    assert "rope_rotate<rotary_half, float, 8, true>" in same    # the template's default: written as read
    assert "rope_rotate<rotary_half, float, 8, true, false>" in mixed    # interleaved in, half-split out
    assert cb.vector_widths("float64") == (1, 2) and cb.vector_widths("float32") == (1, 2, 4)
    assert cb.name_expressions("linear_attention", "bfloat16") == ["linear_attention_chunked<rotary_bfloat16, float>"]
    assert cb.name_expressions("linear_backward", "float64") == ["linear_backward_chunked<double, double>",
                                                                 "linear_backward_finish<double, double>"]
    # linear_backward.cu includes linear_attention.cu (its tiles and feature maps): inlined once, with one header
    text = cb.source_text("linear_backward")
    assert cb.included_sources("linear_backward.cu") == [cb.COMMON_HEADER, "linear_attention.cu"]
    assert '#include "' not in text and text.count("__global__ void linear_attention_chunked(") == 1
    assert text.count("ROTARY_FN void rotate_pair(") == 1


# -- nvcc standalone compile and ptxas report ---------------------------------------------------------
def _nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    return nvcc


def _cuda_resources():
    """benchmarks/cuda_resources.py (the ptxas run and its parser that write docs/cuda.md's tables)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_resources.py"
    spec = importlib.util.spec_from_file_location("cuda_resources_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", list(cb.SOURCES))
def test_each_file_compiles_standalone_with_nvcc(family, tmp_path):
    nvcc = _nvcc()
    supported = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    archs = tuple(a for a in NVCC_ARCHS if f"compute_{a[3:]}" in supported)
    if not archs:
        pytest.skip(f"nvcc supports none of {NVCC_ARCHS}")
    rows, stderr = _cuda_resources().ptxas_report(family, nvcc, tmp_path, archs)   # raises if nvcc fails
    assert "warning" not in stderr.lower(), stderr
    n = sum(len(cb.name_expressions(family, d)) for d in DTYPES)
    assert len(rows) == n * len(archs)
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled

"""Every CUDA kernel instantiation compiles with NVRTC (no GPU needed), and each .cu file with nvcc.

NVRTC comes from CuPy's bindings (``cupy_backends.cuda.libs.nvrtc``) over the NVRTC library of the
``nvidia-cuda-nvrtc-cu12`` wheel (or a CUDA toolkit); the sources are the exact text the CuPy backend
hands to ``cupy.RawModule`` (``rotary.backends.cupy.source_text``) with the same name expressions.
``python -m tests.test_nvrtc`` prints the ptxas registers/spills table of docs/cuda.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rotary.backends import cupy as cb

pytestmark = pytest.mark.nvrtc

#: (NVRTC --gpu-architecture, output): cubin runs ptxas inside NVRTC; PTX checks the front end only
NVRTC_TARGETS = [("compute_70", "ptx"), ("compute_80", "ptx"), ("sm_90", "cubin")]
NVCC_ARCHS = ("sm_90",)          # the test; the docs table (python -m tests.test_nvrtc) adds sm_80
REPORT_ARCHS = ("sm_80", "sm_90")
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


def test_instantiations_cover_every_dtype_width_and_layout():
    names = cb.name_expressions("rope", "float16")
    assert len(names) == 2 * len(cb.vector_widths("float16")) == 8
    assert cb.vector_widths("float64") == (1, 2) and cb.vector_widths("float32") == (1, 2, 4)
    assert cb.name_expressions("linear_attention", "bfloat16") == ["linear_attention_chunked<rotary_bfloat16, float>"]


# -- nvcc standalone compile and ptxas report ---------------------------------------------------------
def _nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    return nvcc


def nvcc_ptxas(family: str, out_dir: Path, nvcc: str = "nvcc", archs=NVCC_ARCHS):
    """Compile cuda_kernels/<family>.cu standalone with every instantiation; returns (returncode, stderr, rows).

    rows: (arch, kernel name expression, registers, spill store bytes, spill load bytes, smem bytes).
    """
    names = [n for dtype in DTYPES for n in cb.name_expressions(family, dtype)]
    tu = out_dir / f"{family}_instances.cu"
    body = ",\n    ".join(f"(const void*)&{n}" for n in names)
    tu.write_text(f'#include "{cb.SOURCES[family]}"\nconst void* rotary_instances[] = {{\n    {body}\n}};\n')
    cmd = [nvcc, "-std=c++17", "-c", "-Xptxas", "-v", f"-I{cb.KERNEL_DIR}", str(tu), "-o", str(out_dir / f"{family}.o")]
    for arch in archs:
        cmd += [f"-gencode=arch=compute_{arch[3:]},code={arch}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows, current = [], None
    demangle = {}
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            current = [m.group(2), m.group(1), None, 0, 0, 0]
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            current[3], current[4] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            current[2] = int(m.group(1))
            rows.append(current)
            current = None
    if shutil.which("c++filt"):
        mangled = sorted({r[1] for r in rows})
        out = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout.split("\n")
        demangle = dict(zip(mangled, out))
    for r in rows:
        r[1] = re.sub(r"\(.*", "", demangle.get(r[1], r[1])).replace("void ", "")
    return proc.returncode, proc.stderr, rows


@pytest.mark.parametrize("family", list(cb.SOURCES))
def test_each_file_compiles_standalone_with_nvcc(family, tmp_path):
    nvcc = _nvcc()
    supported = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    archs = tuple(a for a in NVCC_ARCHS if f"compute_{a[3:]}" in supported)
    if not archs:
        pytest.skip(f"nvcc supports none of {NVCC_ARCHS}")
    code, stderr, rows = nvcc_ptxas(family, tmp_path, nvcc, archs)
    assert code == 0, stderr
    assert "warning" not in stderr.lower(), stderr
    n = sum(len(cb.name_expressions(family, d)) for d in DTYPES)
    assert len(rows) == n * len(archs)
    assert all(r[3] == 0 and r[4] == 0 for r in rows), [r for r in rows if r[3] or r[4]]  # no spills


if __name__ == "__main__":  # markdown table for docs/cuda.md
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print("| arch | kernel | registers | spill stores (B) | spill loads (B) |")
        print("|---|---|---|---|---|")
        for family in cb.SOURCES:
            code, stderr, rows = nvcc_ptxas(family, Path(d), shutil.which("nvcc") or "nvcc", REPORT_ARCHS)
            if code:
                sys.exit(stderr)
            for arch, name, regs, st, ld, _ in sorted(rows):
                print(f"| {arch} | `{name}` | {regs} | {st} | {ld} |")

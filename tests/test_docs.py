"""The docs' own numerical checks, the conformance CLI, and the helpers of the plot and benchmark scripts."""

import argparse
import importlib.util
import io
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rotary
from rotary.cli import conformance as _cli_conformance
from rotary.conformance import cases as _conformance
from rotary.testing import rope_complex

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: pages whose ```python blocks are executed, in order, one namespace per page
PAGES = ["decoding.md", "getting-started.md", "conventions.md", "length-extension.md", "theory.md", "porting.md",
         "multi-axis.md"]


def python_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return [b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if "--8<--" not in b]


def load_script(relpath: str):
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(page, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for block in blocks:
        exec(compile(block, f"docs/{page}", "exec"), namespace)


def test_pages_have_checks():
    assert all(python_blocks(p) for p in PAGES if p != "theory.md")
    assert "--8<-- \"docs/scripts/theory_checks.py:" in (DOCS / "theory.md").read_text()


def test_theory_checks():
    runpy.run_path(str(DOCS / "scripts" / "theory_checks.py"), run_name="__docs__")


def test_theory_page_includes_every_section():
    script = (DOCS / "scripts" / "theory_checks.py").read_text()
    sections = re.findall(r"\[start:(\w+)\]", script)
    page = (DOCS / "theory.md").read_text()
    assert sections and all(f'theory_checks.py:{s}"' in page for s in sections)


# -- conformance CLI ---------------------------------------------------------------------------------
def run_module(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "rotary", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_conformance_cli_quick():
    proc = run_module("conformance", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["backend", "case"])
    assert lines[header].split() == ["backend", "case", "max", "error", "tolerance", "result", "detail"]
    rows = [line.split() for line in lines[header + 2:-1]]
    available = [b for b, (ok, _) in rotary.available_backends().items() if ok]
    from rotary.backends import get

    per_backend = {b: len(_conformance.cases(quick=True))
                   + (len(_conformance.linear_cases(quick=True)) if hasattr(get(b), "linear_attention") else 0)
                   for b in available}
    assert len(rows) == sum(per_backend.values())
    assert {r[1] for r in rows} >= {c.name for c in _conformance.linear_cases(quick=True)}
    assert {r[0] for r in rows} == set(available)
    assert all(r[4] == "pass" and float(r[2]) <= float(r[3]) * 10 for r in rows)
    assert lines[-1].startswith("conformance (quick): OK")


def test_conformance_cli_unavailable_backend():
    avail = rotary.available_backends()
    missing = [b for b, (ok, _) in avail.items() if not ok]
    if not missing:
        pytest.skip("every backend is available here")
    proc = run_module("conformance", "--backend", missing[0])
    assert proc.returncode == 2
    assert f"backend {missing[0]!r} is unavailable" in proc.stdout and "pip install" in proc.stdout


def test_conformance_cli_reports_failure(monkeypatch):
    def fake_run(backends, quick=False):
        return [_conformance.Result("half-basic", "numpy", 1e-7, 2e-6, True, 0.0),
                _conformance.Result("half-fp16", "numpy", 5e-2, 2e-3, False, 0.0, "input was modified")]

    monkeypatch.setattr(_conformance, "run", fake_run)
    out = io.StringIO()
    args = argparse.Namespace(backends=["numpy"], quick=True, failures_only=False)
    assert _cli_conformance.run_cli(args, stdout=out) == 1
    text = out.getvalue()
    assert "FAIL" in text and "input was modified" in text and "1 FAILED" in text
    out = io.StringIO()
    _cli_conformance.run_cli(argparse.Namespace(backends=["numpy"], quick=True, failures_only=True), stdout=out)
    assert "half-basic" not in out.getvalue() and "half-fp16" in out.getvalue()


# -- plot script ------------------------------------------------------------------------------------
def test_precision_figure_data():
    pytest.importorskip("matplotlib")
    pytest.importorskip("mpmath")
    plots = load_script("docs/scripts/make_plots.py")
    data = plots.precision_data(points=8)
    assert data["positions"][-1] == 2**31 - 1
    assert data["rotary_angle"].max() < 1e-6                 # float64 angles: |p| * 2**-53 and less
    assert data["rotary_output"].max() < 1e-6                # fp32 output error independent of position
    far = data["positions"] >= 10**5
    assert data["hf_angle"][far].min() > 1e-3                # what the figure shows for fp32 angles


def test_scaling_figure_data():
    pytest.importorskip("matplotlib")
    plots = load_script("docs/scripts/make_plots.py")
    base, scaled = plots.scaling_frequencies()
    np.testing.assert_allclose(base, 500000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-14)
    np.testing.assert_allclose(scaled["linear (PI)"], base / 8, rtol=1e-14)
    for w in scaled.values():                                 # every rule slows frequencies down by 1..8
        assert np.all(w <= base * (1 + 1e-12)) and np.all(w >= base / 8 * (1 - 1e-12))


def test_multi_axis_figure_data():
    fig = load_script("docs/scripts/plot_multi_axis.py")
    rows = {label.split("\n")[0]: fig.coordinate_map(spec) for label, (spec, _) in fig.FAMILIES.items()}
    axis, shade = rows["Qwen2-VL / Qwen2.5-VL text"]
    assert axis.tolist() == ([0] * 16 + [1] * 24 + [2] * 24) * 2 and shade[0] == 0 and shade[15] == 1
    axis, _ = rows["Qwen3-VL text"]
    assert axis[:6].tolist() == [0, 1, 2, 0, 1, 2] and axis[60:64].tolist() == [0, 0, 0, 0]
    axis, _ = rows["GLM-4V text"]
    assert axis[:4].tolist() == [0, 0, 0, 0] and axis[16:18].tolist() == [1, 1] and set(axis[64:]) == {-1}
    axis, _ = rows["ERNIE-4.5-VL text"]
    assert axis[:6].tolist() == [1, 1, 2, 2, 1, 1] and set(axis[88:]) == {0}
    axis, _ = rows["SAM 2 / SAM 3 ViT"]
    assert axis[:2].tolist() == [1, 1] and axis[32:34].tolist() == [0, 0]


# -- benchmark harness ------------------------------------------------------------------------------
def test_benchmark_naive_peer_matches_oracle():
    bench = load_script("benchmarks/run.py")
    spec = rotary.RopeSpec(128, base=bench.BASE)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 4, 128)).astype(np.float32)
    k = rng.standard_normal((2, 5, 2, 128)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    qr, kr = bench.naive_numpy_hf_style(spec)(q, k, pos)
    for x, y in ((q, qr), (k, kr)):
        ref = rope_complex(np.swapaxes(x, 1, 2), pos[:, None, :], spec.inv_freq())
        np.testing.assert_allclose(np.swapaxes(y, 1, 2), ref, atol=1e-5)


def test_benchmark_markdown_section_replaced(tmp_path):
    bench = load_script("benchmarks/run.py")
    timing = {"seconds": 0.01, "median_seconds": 0.011, "reps": 3, "GBps": 1.0, "fraction_of_copy": 0.1, "max_error": 3e-7,
              "speedup_vs_hf_torch": 2.5}
    data = {"command": "python benchmarks/run.py", "date": "2026-01-01 00:00 UTC",
            "machine": {"cpu": "Test CPU", "logical_cores": 2, "threads": 2, "versions": {"numpy": "2"}},
            "limits": {"numpy_copy_GBps": 10.0, "copy_GBps": 10.0, "sgemm_GFLOPs": 50.0},
            "backends": ["numpy"], "unavailable_backends": {}, "peers": {}, "peer_errors": {}, "error_check": "max error",
            "timing": {"min_time_s": 0.5, "max_reps": 20, "statistic": "min"},
            "results": [{"kind": "apply_qk", "case": "prefill Llama-8B (4096 tok)", "dtype": "float32",
                         "impls": {"rotary[numpy]": timing, "hf-torch-cpu": dict(timing, speedup_vs_hf_torch=1.0)}}]}
    section = bench.markdown(data)
    assert "2.50x" in section and "3.0e-07" in section and "Test CPU" in section and section.startswith(bench.BEGIN)
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\n## Numba CPU backend\n\nkept\n")
    bench.update_docs(page, section)
    bench.update_docs(page, section.replace("Test CPU", "Other CPU"))
    text = page.read_text()
    assert text.count(bench.BEGIN) == 1 and "Other CPU" in text and "Test CPU" not in text
    assert "## Numba CPU backend\n\nkept" in text and text.startswith("# Benchmarks\n")

"""The quick selection of tests/selection.py: what a plain ``python -m pytest`` runs, and what ``--full``,
``CI=true``, test paths and ``-k`` / ``-m`` turn back on; the quick subset still runs every backend on
rotation and on linear attention, and every entry of it names tests that exist."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import selection

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# -- the mechanics, on a small project with this conftest and selection -----------------------------
FAKE_TESTS = {
    "test_conformance.py": "import pytest\n\n"
                           "@pytest.mark.parametrize('backend', ['numpy', 'numba'])\n"
                           "def test_case(backend):\n    pass\n\n"
                           "@pytest.mark.slow\ndef test_slow_case():\n    pass\n",
    "test_nvrtc.py": "def test_compiles():\n    pass\n",
}


HOOKS_IMPORT = "from .selection import pytest_addoption, pytest_collection_modifyitems, pytest_terminal_summary"


def test_conftest_installs_the_selection_hooks():
    assert HOOKS_IMPORT in (TESTS / "conftest.py").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def fake_project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    (root / "tests").mkdir()
    for name in ("__init__.py", "selection.py"):
        shutil.copy(TESTS / name, root / "tests" / name)
    (root / "tests" / "conftest.py").write_text(HOOKS_IMPORT + "\n")      # the real conftest's selection block
    for name, text in FAKE_TESTS.items():
        (root / "tests" / name).write_text(text)
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\nmarkers =\n    slow: slow\n")
    return root


def collected(root, *args, ci=None):
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"            # the installed plugins are not under test here
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {line for line in proc.stdout.splitlines() if "::" in line}, proc.stdout


def test_plain_run_is_the_quick_selection_and_full_runs_everything(fake_project):
    everything = {"tests/test_conformance.py::test_case[numpy]", "tests/test_conformance.py::test_case[numba]",
                  "tests/test_conformance.py::test_slow_case", "tests/test_nvrtc.py::test_compiles"}
    quick, out = collected(fake_project)
    assert quick == {"tests/test_conformance.py::test_case[numpy]", "tests/test_conformance.py::test_case[numba]"}
    assert "test selection: quick (2 of 4 tests)" in out and "--full" in out
    assert collected(fake_project, "--full")[0] == everything
    assert collected(fake_project, ci="true")[0] == everything
    assert collected(fake_project, ci="false")[0] == quick
    assert collected(fake_project, "tests")[0] == quick                       # the default directory, named
    assert collected(fake_project, "tests/test_nvrtc.py")[0] == {"tests/test_nvrtc.py::test_compiles"}
    assert collected(fake_project, "-m", "slow")[0] == {"tests/test_conformance.py::test_slow_case"}
    assert collected(fake_project, "-k", "compiles")[0] == {"tests/test_nvrtc.py::test_compiles"}


def test_is_quick():
    assert selection.is_quick("tests/test_conformance.py::test_case[half-basic-numba]")
    assert not selection.is_quick("tests/test_conformance.py::test_case[half-basic-numba]", ["slow"])
    assert not selection.is_quick("tests/test_peers_hf.py::test_llama", [])
    assert selection.is_quick("tests/test_rope_object.py::test_rope_decode_loop[numba]")
    assert not selection.is_quick("tests/test_rope_object.py::test_rope_cuda_launch_path_through_host_shim")


# -- the real suite ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def suite(request, tmp_path_factory):
    """Every collected node id with its marks: from this session when it collected the whole suite, else
    from a collection of the whole suite in a subprocess."""
    items = getattr(request.config, "_rotary_collected", [])
    if {Path(n.split("::")[0]).name for n, _ in items} >= {"test_conformance.py", "test_docs.py", "test_numba.py"}:
        return dict(items)
    dump = tmp_path_factory.mktemp("collected") / "items.json"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["ROTARY_COLLECTED_JSON"] = str(dump)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--full"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {n: tuple(marks) for n, marks in json.loads(dump.read_text())}


def test_every_quick_entry_names_tests(suite):
    for prefix in selection.QUICK + selection.NOT_QUICK:
        assert any(n.startswith(prefix) for n in suite), f"tests/selection.py: {prefix!r} matches no test"


def test_quick_is_a_proper_subset_that_covers_every_backend(suite):
    quick = [n for n, marks in suite.items() if selection.is_quick(n, marks)]
    assert 0 < len(quick) < len(suite)
    conformance = [n for n in quick if n.startswith("tests/test_conformance.py::")]
    for backend in ("numpy", "numba", "cupy"):              # cupy: on a GPU; without one the host shim below
        assert any(n.startswith("tests/test_conformance.py::test_case[") and n.endswith(f"-{backend}]")
                   for n in conformance), f"quick runs no rotation case on {backend}"
        assert any(n.startswith("tests/test_conformance.py::test_linear_case[") and n.endswith(f"-{backend}]")
                   for n in conformance), f"quick runs no linear-attention case on {backend}"
    shim = [n for n in quick if n.startswith("tests/test_cuda_kernels_cpu.py::")]
    assert any("::test_conformance_case[" in n for n in shim)          # the CUDA kernels without a GPU
    assert any("::test_linear_conformance_case[" in n for n in shim)
    docs = [n for n in quick if n.startswith("tests/test_docs.py::test_python_block[")]
    assert any("[README.md:" in n for n in docs) and any("[docs/getting-started.md:" in n for n in docs)


def test_full_is_the_whole_suite_in_the_readme_and_ci():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "`python -m pytest --full -n auto`" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert any(line.strip() == "python -m pytest --full -n auto" for line in ci.splitlines())

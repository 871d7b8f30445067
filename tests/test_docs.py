"""Every code block of README.md and docs/*.md run as shown, the commands the docs give, the CLI's help,
the conformance CLI, and the helpers of the plot and benchmark scripts.

A Python block runs on its own in a fresh interpreter (its imports are its own; nothing carries over
from an earlier block), from an empty directory, with this checkout's ``rotary`` first on the path.
A block that needs an optional package names it on its first line, ``# needs: torch`` (several:
``# needs: torch, transformers``; ``gpu``: a usable CUDA device), and is skipped with that reason when
one is missing. The blocks run in parallel, one interpreter per core.
"""

import argparse
import ast
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import rotary
from rotary.cli import conformance as _cli_conformance
from rotary.conformance import cases as _conformance
from rotary.conformance import kv_cases as _kv_conformance
from rotary.testing import rope_complex

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: every Markdown file whose code blocks are checked
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
#: top-level modules a block may import without a ``# needs:`` line (the core install)
CORE_MODULES = {"numpy", "rotary"} | set(sys.stdlib_module_names)
#: seconds one block may take (a first Numba compile of several kernels included)
BLOCK_TIMEOUT = 600
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file, as written there."""

    file: str        # path relative to the repository root
    line: int        # 1-based line of the opening fence
    lang: str        # the first word of the info string ("" when there is none)
    indent: str      # the fence's indentation (a block inside a list item)
    code: str        # the lines between the fences, unchanged

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def needs(self) -> tuple[str, ...]:
        """What the first line's ``# needs: a, b`` comment names (module names, or ``gpu``)."""
        first = self.code.split("\n", 1)[0].strip()
        m = re.fullmatch(r"#\s*needs:\s*(.+)", first)
        return tuple(n for n in re.split(r"[,\s]+", m.group(1)) if n) if m else ()


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file, read from the file itself."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence = m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = i + 1
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        assert end < len(lines), f"{rel}:{i + 1}: code block never closed"
        lang = m["info"].split()[0].strip("{}.").lower() if m["info"].strip() else ""
        blocks.append(Block(rel, i + 1, lang, m["indent"], "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for path in MARKDOWN for b in code_blocks(path)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in PYTHON]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL]


def load_script(relpath: str):
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing(block: Block) -> list[str]:
    """The names of ``block.needs`` that this environment lacks."""
    missing = []
    for name in block.needs:
        if name == "gpu":
            if not rotary.available_backends()["cupy"][0]:
                missing.append("gpu (a usable CUDA device)")
        elif importlib.util.find_spec(name) is None:
            missing.append(name)
    return missing


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", block.code], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)


@pytest.fixture(scope="session")
def block_runs(request, tmp_path_factory):
    """Start every selected, runnable Python block at once (one interpreter per core); the tests then wait
    for their own block's result. Under pytest-xdist (``-n``) a worker does not know which blocks it will be
    given, so each block starts when its test runs (the workers are the parallelism)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield _OnDemand(tmp_path_factory)
        return
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_python_block" and hasattr(item, "callspec")]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="docs-block") as pool:
        futures = {b.id: pool.submit(_run_block, b, tmp_path_factory.mktemp("block"))
                   for b in selected if not _missing(b)}
        yield futures
        for f in futures.values():
            f.cancel()


class _OnDemand:
    """block_runs' futures under pytest-xdist: ``runs[block_id].result()`` runs the block then."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory

    def __getitem__(self, block_id):
        block = next(b for b in PYTHON_BLOCKS if b.id == block_id)
        proc = _run_block(block, self._tmp.mktemp("block"))
        return SimpleNamespace(result=lambda: proc)


def _traceback_in_file(block: Block, text: str) -> str:
    """The block's traceback with ``File "<string>", line N`` turned into the Markdown file's line."""
    return re.sub(r'File "<string>", line (\d+)',
                  lambda m: f'File "{block.file}", line {block.line + int(m.group(1))}', text)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block(block, block_runs):
    missing = _missing(block)
    if missing:
        pytest.skip(f"{block.id} needs {', '.join(missing)} (not installed here)")
    proc = block_runs[block.id].result()
    assert proc.returncode == 0, (f"{block.id}: the block exits with status {proc.returncode} when run on its own\n"
                                  + _traceback_in_file(block, proc.stderr[-6000:]))


def test_every_file_is_found():
    names = {b.file for b in PYTHON_BLOCKS}
    assert {"README.md", "docs/getting-started.md", "docs/theory.md", "docs/decoding.md", "docs/interop.md",
            "docs/dask.md", "docs/linear_attention.md"} <= names
    assert len(PYTHON_BLOCKS) >= 40


def test_blocks_are_written_to_paste():
    """Every block names its language; a Python block starts at column 0 (not inside a list item, where
    its indentation would not paste); no snippet include is left for mkdocs to expand."""
    for b in ALL_BLOCKS:
        assert b.lang, f"{b.id}: a code block without a language (```python, ```bash, ```text)"
        if b.lang in PYTHON:
            assert not b.indent, f"{b.id}: an indented Python block does not run when pasted"
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8")
        assert "--8<--" not in text, f"{path.relative_to(ROOT)}: a snippet include, which only mkdocs expands"
    assert "pymdownx.snippets" not in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_blocks_declare_what_they_need():
    """A block that imports a package beyond NumPy and rotary says so on its first line (``# needs: X``),
    so that it is skipped with that reason where X is missing."""
    for b in PYTHON_BLOCKS:
        tree = ast.parse(b.code, filename=b.id)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
        undeclared = imported - CORE_MODULES - set(b.needs)
        assert not undeclared, f"{b.id}: imports {sorted(undeclared)}; first line: # needs: {', '.join(sorted(undeclared))}"
        later = [line for line in b.code.split("\n")[1:] if re.match(r"\s*#\s*needs:", line)]
        assert not later, f"{b.id}: '# needs:' belongs on the block's first line"


def _shell_commands(block: Block):
    """The commands of a shell block: comments and ``$ `` prompts dropped, split at ``&&``, ``;`` and ``|``."""
    for line in block.code.split("\n"):
        line = line.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue                      # output lines
            line = line[2:]
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in re.split(r"&&|;|\|", line):
            if part.strip():
                yield part.strip()


def _rotary_argv(command: str):
    """``python -m rotary ...`` as its argument list after ``rotary``, else None."""
    words = shlex.split(command)
    for i in range(len(words) - 2):
        if words[i].startswith("python") and words[i + 1:i + 3] == ["-m", "rotary"]:
            return words[i + 3:]
    return None


def _parses(argv) -> bool:
    from rotary.__main__ import build_parser

    try:
        with open(os.devnull, "w") as sink:
            stdout, sys.stdout = sys.stdout, sink
            try:
                build_parser().parse_args(argv)
            finally:
                sys.stdout = stdout
    except SystemExit as exc:
        return exc.code == 0                 # --help / --version
    return True


def test_rotary_commands_in_the_docs_parse():
    """Every ``python -m rotary ...`` a shell block shows is a command line this version accepts."""
    seen = 0
    for b in SHELL_BLOCKS:
        for command in _shell_commands(b):
            argv = _rotary_argv(command)
            if argv is not None:
                seen += 1
                assert _parses(argv), f"{b.id}: {command!r} is not a valid command line"
    assert seen >= 4


def test_scripts_in_the_docs_exist():
    """Every script a shell block runs (``python path.py``, ``bash path.sh``) is in the repository."""
    seen = 0
    for b in SHELL_BLOCKS:
        for command in _shell_commands(b):
            for script in re.findall(r"(?:^|\s)(?:python3?|bash)\s+(\S+\.(?:py|sh))\b", command):
                seen += 1
                assert (ROOT / script).is_file(), f"{b.id}: {command!r} runs {script}, which does not exist"
    assert seen >= 5


#: scripts a page gives as a command to run (in place of including them), run here as the page says
RUN_SCRIPTS = {"docs/scripts/numpy_decoder.py": "docs/decoding.md"}


@pytest.mark.parametrize("script", sorted(RUN_SCRIPTS))
def test_documented_script_runs(script):
    commands = [c for b in SHELL_BLOCKS if b.file == RUN_SCRIPTS[script] for c in _shell_commands(b)]
    assert f"python {script}" in commands
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip()


def test_readme_quick_start_is_two_commands():
    """README's Quick start: one command installs and runs the demo, one installs and runs the tests."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):].split("\n## ", 1)[0]
    first = next(b for b in SHELL_BLOCKS if b.file == "README.md" and f"```{b.lang}\n{b.code}" in section)
    assert [line for line in first.code.split("\n") if line.strip()] == [
        'pip install ".[numba]" && python -m rotary demo', 'pip install ".[test,numba]" && python -m pytest']


# -- the command line's help ------------------------------------------------------------------------
def test_bare_command_prints_the_help():
    proc = run_module()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m rotary") and not proc.stderr
    for verb in ("info", "demo", "conformance", "inspect", "warm"):
        assert f"python -m rotary {verb}" in proc.stdout          # each verb with an example


def _verbs():
    from rotary.__main__ import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, action.choices


def test_every_verb_shows_an_example():
    """``python -m rotary VERB --help`` ends with examples, and every example is a valid command line."""
    parser, verbs = _verbs()
    assert {"info", "demo", "conformance", "inspect"} <= set(verbs)
    for verb, sub in [(None, parser), *verbs.items()]:
        text = sub.format_help()
        examples = [line.strip() for line in text.split("\n") if line.strip().startswith("python -m rotary")]
        assert "example" in text and examples, f"{verb}: --help shows no example"
        if verb is not None:
            assert any(e.split()[3:4] == [verb] for e in examples), f"{verb}: no example runs {verb}"
        for example in examples:
            if "VERB" in example:
                continue
            command = re.split(r"\s#|\|", example)[0]
            assert _parses(_rotary_argv(command)), f"{verb}: example {example!r} does not parse"


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
                   + len(_kv_conformance.kv_cases(quick=True))
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

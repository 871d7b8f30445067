"""The quick selection: what ``python -m pytest`` runs without ``--full``.

``python -m pytest`` (no paths, no ``-k`` / ``-m``) runs the tests whose node id starts with one of
``QUICK`` and that carry none of ``FULL_ONLY_MARKS``: every backend (NumPy, Numba, the CUDA kernels
through the host shim) on the conformance cases of rotation and of linear attention, the errors, the
frontend, the CLI and the first pages of the docs, in minutes on a 2-core machine with an empty Numba
cache. ``python -m pytest --full`` (or ``CI=true``, or naming test files or a ``-k`` / ``-m``
expression) runs everything: the peers against HF transformers, NVRTC builds, the property tests, every
docs page and every interop adapter. ``tests/test_suite_selection.py`` checks the mechanics.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: node-id prefixes of the quick selection (a file, a test, or a parametrized test's id start)
QUICK = (
    "tests/test_conformance.py",                 # every backend x every rotation and linear-attention case
    "tests/test_cuda_kernels_cpu.py::test_conformance_case",    # the CUDA kernels' rotation on the host shim
    "tests/test_cuda_kernels_cpu.py::test_linear_conformance",  # ... and their linear attention
    "tests/test_rotation.py",
    "tests/test_numpy_backend.py",
    "tests/test_edge_cases.py",
    "tests/test_errors.py",
    "tests/test_error_catalogue.py",
    "tests/test_small_calls.py",
    "tests/test_positions.py",
    "tests/test_multi_axis.py",
    "tests/test_scaling.py",
    "tests/test_exact_angles.py",
    "tests/test_hf_config.py",
    "tests/test_rope_object.py",
    "tests/test_plan.py",
    "tests/test_given_tables.py",
    "tests/test_attention_softmax.py",
    "tests/test_kv_cache.py",                    # the KV cache against float64 oracles (seconds)
    "tests/test_kv_primitives.py",               # kv_append / paged_attention: every backend, the CUDA shim too
    "tests/test_kv_prepared.py",                 # ... prepared once per step, run per layer (seconds)
    "tests/test_kv_engine_cache.py",             # layers, fork, prefix reuse, truncate, insert, windows (seconds)
    "tests/test_engine_hf.py",                   # the engine without torch (documents, forks, vs generate; ~5 s)
    "tests/test_linear_attention.py::test_matches_oracle",
    "tests/test_layers.py",
    "tests/test_package.py",
    "tests/test_suite_selection.py",
    "tests/test_docs.py::test_python_block[README.md:",
    "tests/test_docs.py::test_python_block[docs/getting-started.md:",
    "tests/test_docs.py::test_blocks_",
    "tests/test_docs.py::test_rotary_commands_in_the_docs_parse",
    "tests/test_docs.py::test_scripts_in_the_docs_exist",
    "tests/test_docs.py::test_readme_quick_start_is_two_commands",
    "tests/test_docs.py::test_bare_command_prints_the_help",
    "tests/test_docs.py::test_every_verb_shows_an_example",
)

#: node-id prefixes kept out of the quick selection even under a QUICK prefix
NOT_QUICK = (
    "tests/test_rope_object.py::test_rope_cuda_launch_path_through_host_shim",   # a second host-shim build (~10 s)
)

#: marks that keep a test out of the quick selection even under a QUICK prefix
FULL_ONLY_MARKS = ("slow", "peer", "nvrtc", "sanitizer")

#: environment variable values that turn the full suite on (CI services set CI=true)
_TRUE = {"1", "true", "yes"}


def full_from_environment() -> bool:
    return os.environ.get("CI", "").strip().lower() in _TRUE


def is_quick(nodeid: str, marks=()) -> bool:
    """Whether the test ``nodeid`` (carrying the mark names ``marks``) belongs to the quick selection."""
    return nodeid.startswith(QUICK) and not nodeid.startswith(NOT_QUICK) and not set(marks) & set(FULL_ONLY_MARKS)


# -- the hooks (tests/conftest.py imports them) ----------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the whole suite; without it, a plain `python -m pytest` runs the quick selection "
                          "of tests/selection.py (also on when CI=true, or when test paths, -k or -m are given)")


def _selection_is_quick(config) -> bool:
    """The quick selection applies to a plain run: no --full, no CI=true, no paths other than the
    default tests directory, no -k / -m expression."""
    if config.getoption("--full") or full_from_environment():
        return False
    if config.getoption("keyword") or config.getoption("markexpr"):
        return False
    tests_dir = Path(__file__).resolve().parent
    return all(Path(config.invocation_params.dir, arg).resolve() == tests_dir
               for arg in config.option.file_or_dir or ())


def pytest_collection_modifyitems(config, items):
    config._rotary_collected = [(it.nodeid, tuple(m.name for m in it.iter_markers())) for it in items]
    if os.environ.get("ROTARY_COLLECTED_JSON"):     # tests/test_suite_selection.py reads what was collected
        Path(os.environ["ROTARY_COLLECTED_JSON"]).write_text(json.dumps(config._rotary_collected))
    if not _selection_is_quick(config):
        config._rotary_selection = f"full ({len(items)} tests)"
        return
    keep, dropped = [], []
    for item in items:
        (keep if is_quick(item.nodeid, [m.name for m in item.iter_markers()]) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    config._rotary_selection = (f"quick ({len(keep)} of {len(keep) + len(dropped)} tests); "
                                "`python -m pytest --full` runs them all")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    selection = getattr(config, "_rotary_selection", None)
    if selection:
        terminalreporter.write_line(f"test selection: {selection}")

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

import os

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
    "tests/test_attention_softmax.py",
    "tests/test_linear_attention.py::test_matches_oracle",
    "tests/test_layers.py",
    "tests/test_package.py",
    "tests/test_suite_selection.py",
    "tests/test_docs.py::test_python_block[README.md:",
    "tests/test_docs.py::test_python_block[docs/getting-started.md:",
    "tests/test_docs.py::test_blocks_",
    "tests/test_docs.py::test_rotary_commands_in_the_docs_parse",
    "tests/test_docs.py::test_scripts_in_the_docs_exist",
    "tests/test_docs.py::test_bare_command_prints_the_help",
    "tests/test_docs.py::test_every_verb_shows_an_example",
)

#: marks that keep a test out of the quick selection even under a QUICK prefix
FULL_ONLY_MARKS = ("slow", "peer", "nvrtc", "sanitizer")

#: environment variable values that turn the full suite on (CI services set CI=true)
_TRUE = {"1", "true", "yes"}


def full_from_environment() -> bool:
    return os.environ.get("CI", "").strip().lower() in _TRUE


def is_quick(nodeid: str, marks=()) -> bool:
    """Whether the test ``nodeid`` (carrying the mark names ``marks``) belongs to the quick selection."""
    return nodeid.startswith(QUICK) and not set(marks) & set(FULL_ONLY_MARKS)

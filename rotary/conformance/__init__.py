"""Conformance: rotary's cases against float64 oracles.

- :func:`check` (``rotary.conformance.check``): the cases run against anyone's RoPE through an adapter per
  signature (plain, HF, flash-attn, vLLM, MLX), with a report per case and a diagnosis of failures
  (``python -m rotary conformance --impl package.module:function``; docs/conformance.md), and
  :func:`conformance_cases`, the same cases as pytest parameters for a project's own suite;
- :mod:`.cases`: the cross-backend cases of rotary's own backends (the tests and ``python -m rotary
  conformance``); :mod:`.kv_cases` the KV-cache cases; :mod:`.error_cases` the bad-input catalogue
  (``python -m rotary conformance --errors``).

Importing this package imports NumPy and rotary only (torch, JAX, MLX and matplotlib load when a check
uses them).
"""

from .adapters import SIGNATURES, NotApplicable
from .check import CaseResult, ImplCase, Report, check, conformance_cases   # noqa: F811 (check shadows the module)

__all__ = ["check", "conformance_cases", "Report", "CaseResult", "ImplCase", "NotApplicable", "SIGNATURES"]

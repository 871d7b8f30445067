"""The JAX pytree of :class:`rotary.LinearAttentionState`, registered when ``jax`` is imported, without importing it.

:func:`install` (called where the state class is defined, :mod:`rotary.attn.linear_state`) registers the pytree
at once when jax is loaded, else puts a one-shot finder on ``sys.meta_path`` that registers it right after
``jax`` is imported (:class:`.torch_hook._AfterImport`, the hook torch.compile's handlers use). So a state made by
a NumPy call is a ``lax.scan`` / ``fori_loop`` carry before any JAX array has reached rotary, whichever of
rotary and jax was imported first; ``import rotary`` still imports neither jax nor torch.
"""

from __future__ import annotations

import importlib
import sys

from .torch_hook import _AfterImport

_JAX = "jax"


def _register():
    """The JAX adapter registers the pytree when it is imported (jax is loaded by now)."""
    importlib.import_module("rotary.interop.jax_adapter")


def install():
    """The pytree now if jax is loaded, else when it is (once)."""
    if _JAX in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) and f.name == _JAX for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_JAX, _register))

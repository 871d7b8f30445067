"""Registration of rotary's torch.compile handlers when ``torch._dynamo`` loads, without importing torch.

:func:`install` (called by :mod:`.torch_ops`; ``import rotary`` may call it too, see docs/interop.md)
registers the handlers at once when Dynamo is loaded, else puts a one-shot finder on ``sys.meta_path``
(:func:`rotary.attn.linear_state.after_import`, which also makes the linear-attention state a JAX pytree when
jax loads) that registers them right after ``torch._dynamo`` is imported (``torch.compile`` imports it before
it traces anything). Nothing here imports torch: a process that never compiles pays nothing.
"""

from __future__ import annotations

import importlib
import sys

from ..attn.linear_state import after_import

_DYNAMO = "torch._dynamo"


def _register():
    """Import the ops and install the handlers with Dynamo off: this may run inside a call that Dynamo
    compiles (the first torch call of rotary under torch.compile), whose new frames Dynamo would trace. A torch
    adapter imported before Dynamo loaded gets its eager entry points now (the forms without an op run
    eagerly under Dynamo, a graph break, instead of Dynamo tracing rotary's Python)."""
    disable = sys.modules["torch"].compiler.disable
    disable(lambda: importlib.import_module("rotary.interop.torch_ops").register())()
    eager = getattr(sys.modules.get("rotary.interop.torch_adapter"), "_eager_under_dynamo", None)
    if eager is not None:   # (an adapter still being imported calls it itself, at its end)
        eager()


def install():
    """The handlers now if ``torch._dynamo`` is loaded, else when it is (once)."""
    if _DYNAMO in sys.modules:
        if "torch" in sys.modules and hasattr(sys.modules["torch"].library, "custom_op"):
            _register()
    else:
        after_import(_DYNAMO, _register)

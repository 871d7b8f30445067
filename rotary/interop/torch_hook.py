"""Registration of rotary's torch.compile handlers when ``torch._dynamo`` loads, without importing torch.

:func:`install` (called by :mod:`.torch_ops`; ``import rotary`` may call it too, see docs/interop.md)
registers the handlers at once when Dynamo is loaded, else puts a one-shot finder on ``sys.meta_path``
that registers them right after ``torch._dynamo`` is imported (``torch.compile`` imports it before it
traces anything). Nothing here imports torch: a process that never compiles pays nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_DYNAMO = "torch._dynamo"


def _register():
    """Import the ops and install the handlers with Dynamo off: this may run inside a call that Dynamo
    compiles (the first torch call of rotary under torch.compile), whose new frames Dynamo would trace."""
    disable = sys.modules["torch"].compiler.disable
    disable(lambda: importlib.import_module("rotary.interop.torch_ops").register())()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a module has been imported (its body executed), then leaves sys.meta_path."""

    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_call(module):
            exec_module(module)
            try:
                callback()
            except Exception as exc:   # never break the import of the module itself
                warnings.warn(f"rotary could not register its hook for {fullname}: {exc!r}", stacklevel=2)

        spec.loader.exec_module = exec_then_call
        return spec


def install():
    """The handlers now if ``torch._dynamo`` is loaded, else when it is (once)."""
    if _DYNAMO in sys.modules:
        if "torch" in sys.modules and hasattr(sys.modules["torch"].library, "custom_op"):
            _register()
    elif not any(isinstance(f, _AfterImport) and f.name == _DYNAMO for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_DYNAMO, _register))

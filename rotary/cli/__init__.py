"""The verbs of ``python -m rotary`` that live in their own modules: ``conformance`` and ``inspect``
(``rotary/__main__.py`` is the entry point, with ``info`` and ``demo``)."""

"""Worked examples shipped with the package, imported only when asked (``import rotary`` never loads them).

* :mod:`rotary.examples.decoder`: a decoder-only transformer in NumPy + rotary (Llama 3.1, Qwen3, Gemma 3 text
  read from a Hugging Face config) over one multi-layer :class:`rotary.KVCache` per kind of layer, and its greedy
  ``generate``;
* :mod:`rotary.examples.engine`: a small continuous-batching engine over that decoder (admission, prefill chunks
  and decode tokens in one forward per step, EOS, parallel sampling by ``fork``, speculative rollback by
  ``truncate``, prefix reuse, position-independent reuse of a cached document by ``export`` / ``insert``);
* :mod:`rotary.examples.linear_training`: a 2-layer RoFormer-style linear-attention model trained on a copy task
  in NumPy with ``rotary.linear_attention`` and its backward primitive, beside torch autograd on the same weights
  (``tests/test_linear_training.py``; docs/linear_attention.md).

The first two are checked token for token against Hugging Face ``generate`` (``tests/test_decoding_hf.py``,
``tests/test_engine_hf.py``); docs/decoding.md walks through them.
"""

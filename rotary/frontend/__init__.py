"""The entry points that rotate arrays: :func:`~.rotate.apply`, :func:`~.rotate.apply_qk` and
:class:`~.rope.Rope`, on top of :mod:`.normalize`, the one normaliser of axes, positions, out buffers and
the backend choice that every entry point (the attention functions included) calls; :mod:`.dispatch`
hands torch / JAX / Dask / bfloat16 arrays to their adapters in :mod:`rotary.interop`."""

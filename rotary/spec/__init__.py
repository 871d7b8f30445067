"""What to rotate by: :class:`RopeSpec` (the one source of frequencies and layouts) and everything it is
made from or turned into on the host, in float64.

:mod:`.rope_spec` the spec; :mod:`.scaling` the length-extension rules; :mod:`.hf_config` reading HF
configs; :mod:`.angles` exact angles (two-product, double-double reduction); :mod:`.tables` the cos/sin
tables and their cache; :mod:`.positions` token coordinates (grids, M-RoPE ids); :mod:`.packing` packed
batches (cu_seqlens); :mod:`.validators` checked scalars; :mod:`.diagnostics` decay curves and layout
conversions. Plain NumPy on the host: nothing here runs a kernel or imports a backend.
"""

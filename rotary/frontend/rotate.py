"""``apply`` and ``apply_qk``: rotate arrays through a backend and return the caller's array type.

``rotate_arrays`` is their shared body: the call's plan (:mod:`rotary.frontend.plan`, the checks of its
geometry made once) turns the inputs into canonical ``(B, S, H, D)`` views and int64 positions,
:mod:`rotary.spec.tables` gives the cos/sin rows, and the backend's prepared rotation or ``rotate``
primitive (contract in :mod:`rotary.backends`) does the work.
"""

from __future__ import annotations

from ..spec.given_tables import angle_tables, cos_sin_cache_tables
from . import dispatch as _adapters
from .axes import normalize_seq_axis, take_tensor_layout
import numpy as np

from .buffers import CheckedBuffers, check_memory
from .plan import planned
from .positions import packed_positions

# -- rotation ------------------------------------------------------------------------------------
#: the last prepared NumPy call's arrays (weak references; see CheckedBuffers) with its plan: the same live arrays,
#: unchanged, in a call of the same spec and options keep that plan and the memory rules' verdict
_checked = None


@_adapters.dispatch("rotate", 1)   # torch, JAX, Dask arrays: rotary/interop/
def rotate_arrays(xs, outs, names, positions, *, spec, seq_axis, inverse, backend, spec_kwargs, tables=None,
                  out_pairs=None):
    """Shared body of apply/apply_qk: rotate each x of ``xs`` (same batch/seq/head_dim) through the call's
    plan (:mod:`.plan`: checked once per geometry, its memory rules every call).

    ``tables(spec, pos, dtype, device_key, convert) -> (cos, sin, rows)`` replaces the table lookup of the
    normalized positions ``pos`` (rerotate gives table rows of angle differences). ``out_pairs``: the pair
    layout of the outputs (None: the spec's)."""
    global _checked
    checked, arrays = _checked, (*xs, *outs)
    extra = (spec, seq_axis, inverse, backend, out_pairs, spec_kwargs)   # (the spec held: its identity compared)
    if tables is None and checked is not None and checked.same(arrays, extra) and checked.value.current():
        plan, apart = checked.value, True   # the last call's live arrays: its plan and memory verdict hold
    else:
        plan = planned(xs, outs, names, spec=spec, seq_axis=seq_axis, inverse=inverse, backend=backend,
                       spec_kwargs=spec_kwargs, out_pairs=out_pairs)
        apart = check_memory(xs, outs, plan.names, plan.out_layout is not None)
        if apart and plan.prepared is not None and tables is None and type(xs[0]) is np.ndarray:
            _checked = CheckedBuffers.record(arrays, extra, plan)
    if plan.prepared is not None and tables is None and apart:
        result = plan.run_prepared(xs, outs, positions)
        if result is not None:
            return result
    return plan.run(xs, outs, positions, tables)


def check_angles_unpacked(angles, cu_seqlens, seqlen_offsets):
    """angles give each token its angles, so the packed-batch arguments (which set positions) do not apply."""
    if angles is not None and (cu_seqlens is not None or seqlen_offsets is not None):
        given = "cu_seqlens" if cu_seqlens is not None else "seqlen_offsets"
        raise ValueError(f"angles give every token's angles; {given} only sets positions (restarting per packed "
                         "sequence), which angles replace: pass the angles of the packed tokens, shape "
                         "(total_tokens, rotary_dim / 2), without cu_seqlens / seqlen_offsets")


def given_values(x, name, positions, spec, seq_axis, spec_kwargs, cos_sin_cache, angles):
    """``(positions, tables, spec_kwargs)`` of a call that brings its own cos/sin values (``cos_sin_cache`` or
    ``angles``, see :mod:`rotary.spec.given_tables`), or the arguments unchanged (tables None)."""
    if cos_sin_cache is None and angles is None:
        return positions, None, spec_kwargs
    if cos_sin_cache is not None and angles is not None:
        raise ValueError("pass cos_sin_cache or angles, not both")
    if cos_sin_cache is not None:
        tables, rotary_dim = cos_sin_cache_tables(cos_sin_cache)
        what = f"cos_sin_cache of {rotary_dim} columns"
    else:
        if positions is not None:
            raise ValueError("angles give every token's angles: pass angles or positions, not both")
        tables, rotary_dim, positions = angle_tables(angles)
        ax = normalize_seq_axis(seq_axis, x.ndim, name)
        seq_len, shape = x.shape[ax], (*positions.shape, rotary_dim // 2)
        if positions.shape[-1] != seq_len:
            raise ValueError(f"angles of {positions.shape[-1]} tokens do not match {name}'s sequence length {seq_len}")
        if positions.ndim == 2 and ax == 0:
            raise ValueError(f"angles of shape {shape} have a batch axis, but {name} has no batch axis before its "
                             f"sequence axis: pass angles of shape {shape[1:]}")
        if positions.ndim == 2 and positions.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"angles of shape {shape} have {shape[0]} batch rows, but {name}'s batch axis has "
                             f"{x.shape[0]}: pass {shape[1:]} (the same for every row) or {(x.shape[0], *shape[1:])}")
        what = f"angles of {rotary_dim // 2} pairs"
    if spec is None:
        spec_kwargs = {**spec_kwargs}
        if spec_kwargs.setdefault("rotary_dim", rotary_dim) != rotary_dim:
            raise ValueError(f"rotary_dim={spec_kwargs['rotary_dim']} does not match {what} (rotary_dim {rotary_dim})")
    elif getattr(spec, "rotary_dim", rotary_dim) != rotary_dim:
        raise ValueError(f"spec.rotary_dim ({spec.rotary_dim}) does not match {what} (rotary_dim {rotary_dim})")
    return positions, tables, spec_kwargs


def apply(x, positions=None, *, spec=None, seq_axis=None, inverse=False, out=None, backend="auto", cu_seqlens=None,
          seqlen_offsets=None, cos_sin_cache=None, angles=None, out_pairs=None, **spec_kwargs):
    """Rotate ``x`` (..., seq, ..., head_dim) by RoPE at ``positions``; returns x's array type and dtype.

    ``y_a = x_a cos(p w_i) - x_b sin(p w_i)``, ``y_b = x_b cos(p w_i) + x_a sin(p w_i)`` for each pair
    (a, b) of the spec's layout, ``w_i`` from ``spec.inv_freq()``; the pairs lie in coordinates
    ``[rotary_offset, rotary_offset + rotary_dim)`` and every other coordinate passes through.

    Parameters
    ----------
    x : array, real floating
        ``(seq, dim)``, or any number of axes with the sequence axis named by ``seq_axis``.
    positions : None, int or integer array
        None -> 0..seq-1; int -> offset + 0..seq-1; shape (seq,) or (batch, seq), batch = x.shape[0].
    spec : RopeSpec, optional
        Or give ``base=``, ``layout=``, ``rotary_dim=``, ``scaling=``, ``max_position_embeddings=``,
        ``rotary_offset=``.
    seq_axis : int or str, required for 3 or more dimensions
        The sequence axis (e.g. 1 for BSHD, 2 for BHSD), or the layout of x's axes ("bshd", "bhsd", "thd",
        "shd", ...; also accepted as ``layout=``, whose "half" / "interleaved" stay the spec's pair layout).
        A 2-D x is ``(seq, dim)``; any other x must name it (no default that could rotate along the heads).
    inverse : bool
        Rotate by -angle (undo a rotation; the backward of RoPE).
    out : array, optional
        Where to write (same shape/dtype/type as x); may be ``x`` itself for in place.
    backend : {"auto", "numpy", "numba", "cupy"}
    cu_seqlens : integer array (N+1,), optional
        A packed batch (flash-attn's varlen/THD form): N sequences concatenated along the sequence
        axis (x of shape (total_tokens, heads, head_dim) with ``seq_axis=0``), sequence n owning tokens
        ``cu_seqlens[n]:cu_seqlens[n+1]``. Positions restart at each sequence (at
        ``seqlen_offsets[n]``, default 0); explicit per-token ``positions`` may be given instead.
        One pass over all sequences.
    seqlen_offsets : int or integer array (N,), optional
        Per-sequence position offsets with ``cu_seqlens`` (a sequence continuing a cache of L tokens
        has offset L).
    cos_sin_cache : float array (max_position, rotary_dim), optional
        The caller's cos/sin table instead of the spec's frequencies (vLLM / SGLang / FlashInfer's
        ``cos_sin_cache``: cos in the first rotary_dim/2 columns, sin in the rest), read at ``positions``.
    angles : float array (seq, rotary_dim/2) or (batch, seq, rotary_dim/2), optional
        Every token's angles instead of positions and frequencies (TransformerEngine's ``freqs``; see
        :mod:`rotary.spec.given_tables`). With either, the spec gives only the layout, rotary_dim and offset.
    out_pairs : {None, "half", "interleaved"}
        The pair layout the result is written in (None: the spec's layout). Pairs are read in the spec's
        layout and pair i is written to ``(i, i + rotary_dim/2)`` ("half") or ``(2i, 2i+1)`` ("interleaved"):
        ``layout="interleaved", out_pairs="half"`` is DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` (MLA)
        in one pass. When it differs from the spec's layout the call cannot run in place: ``out`` must share
        no memory with x. With ``inverse`` the pairs are still read in the spec's layout.
    """
    seq_axis, spec_kwargs = take_tensor_layout(seq_axis, spec_kwargs)
    check_angles_unpacked(angles, cu_seqlens, seqlen_offsets)
    positions, _ = packed_positions(x, seq_axis, positions, cu_seqlens, seqlen_offsets, spec=spec)
    positions, tables, spec_kwargs = given_values(x, "x", positions, spec, seq_axis, spec_kwargs, cos_sin_cache, angles)
    return rotate_arrays([x], [out], ["x"], positions, spec=spec, seq_axis=seq_axis, inverse=inverse,
                         backend=backend, spec_kwargs=spec_kwargs, out_pairs=out_pairs,
                         **({"tables": tables} if tables else {}))[0]


def apply_qk(q, k, positions=None, *, spec=None, seq_axis=None, inverse=False, out=None, backend="auto",
             cu_seqlens=None, seqlen_offsets=None, cos_sin_cache=None, angles=None, out_pairs=None, **spec_kwargs):
    """Rotate q and k together (one pass / one launch); head counts may differ (GQA).

    Same arguments as :func:`apply` (``cu_seqlens``/``seqlen_offsets`` for packed q and k, ``cos_sin_cache`` /
    ``angles`` for the caller's own values, ``out_pairs`` for both outputs' pair layout); ``out`` is None or a
    pair ``(q_out, k_out)`` (either may be None; ``out=(q, k)`` rotates in place). Returns ``(q_rot, k_rot)``.
    """
    if out is None:
        outs = [None, None]
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        outs = list(out)
    else:
        raise TypeError("out must be None or a pair (q_out, k_out)")
    seq_axis, spec_kwargs = take_tensor_layout(seq_axis, spec_kwargs)
    check_angles_unpacked(angles, cu_seqlens, seqlen_offsets)
    positions, _ = packed_positions(q, seq_axis, positions, cu_seqlens, seqlen_offsets, "q", spec)
    positions, tables, spec_kwargs = given_values(q, "q", positions, spec, seq_axis, spec_kwargs, cos_sin_cache, angles)
    q_rot, k_rot = rotate_arrays([q, k], outs, ["q", "k"], positions, spec=spec, seq_axis=seq_axis,
                                 inverse=inverse, backend=backend, spec_kwargs=spec_kwargs, out_pairs=out_pairs,
                                 **({"tables": tables} if tables else {}))
    return q_rot, k_rot

"""Linear attention with RoPE in the numerator only (RoFormer eq. 19), causal or not, resumable.

With a_t = phi(q_t), b_t = phi(k_t), R_p the spec's rotation at position p and a per-head decay
gamma in (0, 1] (1 without ``decay``)::

    o_t = sum_s gamma^(t-s) (R_{p_t} a_t)^T (R_{p_s} b_s) v_s  /  (sum_s gamma^(t-s) a_t^T b_s + eps)

s over every token (``causal=False``, no decay) or s <= t (``causal=True``); ``normalize=False``
keeps the numerator alone (RetNet's retention with identity features and RetNet's gammas). The
denominator is unrotated, so it stays positive for positive feature maps (RoFormer §3.3); the
weights then do not sum to 1 (see docs/linear_attention.md). k and v may have fewer heads than q
(GQA: q head h reads k/v head h // (H / H_kv) along the one axis where their shapes differ). A
:class:`LinearAttentionState` carries ``S = sum_s gamma^(T-1-s) (R_{p_s} b_s) v_s^T`` and
``z = sum_s gamma^(T-1-s) b_s`` per k/v head (prefill, then decode or the next segment). The backend
primitive is ``linear_attention`` of ``rotary.backends`` (contract in ``rotary.backends``' docstring).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import device as xp_device

from ..frontend import dispatch as _adapters
from ..frontend.normalize import (canonical, canonical_axes, canonical_shape, check_float, from_canonical, namespace,
                                  next_position, normalize_positions, normalize_seq_axis, packed_positions,
                                  pick_backend, resolve_spec, start_positions, table_converter, to_numpy)
from ..spec import tables as _tables
from ..spec.rope_spec import RopeSpec
from .linear_args import check_decay, check_scalars, check_shapes
from .linear_decode import decode_step, make_decode_step
from .linear_state import (FEATURE_MAPS, LinearAttentionState, SavedForBackward, check_feature_map,  # noqa: F401
                           check_state, saved_fingerprint)   # (FEATURE_MAPS: the names linear_attention takes)


# -- public ------------------------------------------------------------------------------------
def _gqa_permutation(ndim, ax, gax):
    """Axis order that makes the GQA axis the innermost canonical head axis (None: already is)."""
    if gax is None:
        return None
    heads = canonical_axes(ndim, ax)[1]
    if heads and heads[-1] == gax:
        return None
    return tuple(i for i in range(ndim - 1) if i != gax) + (gax, ndim - 1)


def _other_perm(ndim, ax, perm):
    """How ``perm`` reorders the axes other than seq and last (for states and decay)."""
    other = [i for i in range(ndim - 1) if i != ax]
    if perm is None:
        return list(range(len(other)))
    return [other.index(i) for i in perm[:-1] if i != ax]


@_adapters.dispatch("linear_attention", 3)   # torch, JAX, Dask: rotary/_torch.py, _jax.py, _dask.py
def linear_attention(q, k, v, positions=None, *, causal=False, feature_map="elu", eps=1e-6, spec=None,
                     seq_axis=None, state=None, return_state=False, backend="auto", chunk=64, decay=None,
                     normalize=True, cu_seqlens=None, seqlen_offsets=None, save_for_backward=False, **spec_kwargs):
    """Linear attention with RoPE on the feature-mapped q and k, numerator only (RoFormer eq. 19).

    ``o_t = sum_s gamma^(t-s) (R_{p_t} a_t)^T (R_{p_s} b_s) v_s / (sum_s gamma^(t-s) a_t^T b_s + eps)``
    with a = phi(q), b = phi(k), gamma = ``decay`` (1 by default); s <= t when ``causal``, every s
    otherwise; a ``state`` adds its earlier tokens to both sums. ``normalize=False``: the numerator
    alone (no denominator, ``eps`` unused).

    Parameters
    ----------
    q : array (..., seq, ..., d)
    k : array
        q's shape, or (GQA) q's shape with fewer heads in one head axis (not the first, batch axis),
        q's size a multiple G of k's there: q head h reads k/v head h // G.
    v : array, k's shape with its own last dim dv
    positions : None, int or integer array
        As in :func:`rotary.apply`. None: 0..seq-1, or with a ``state`` its ``next_position`` onwards.
    causal : bool
    feature_map : {"elu", "relu", "identity"} or callable
        "elu" is elu(x) + 1 (Katharopoulos et al.). A callable gets q (and k) as float32 arrays
        (float64 for float64 input) of the input's array type and returns phi(q) (..., m); m may differ
        from d, and the spec then describes m. It runs here, before the backend (which then gets
        "identity"), so every backend takes it. Positive maps keep the denominator > 0.
    eps : float >= 0
        Added to the denominator.
    spec : RopeSpec, optional
        Or the spec keywords (``base=``, ``layout=``, ...). With a ``state`` and no spec given, the
        state's spec. The spec's attention scaling multiplies the numerator by its square.
    seq_axis : int or str
        The sequence axis, or the layout of q's axes ("bshd", "bhsd", "thd", ...; also as ``layout=``), as in
        :func:`rotary.apply`: named for 3 or more dimensions.
    state : LinearAttentionState, optional
        The sums of earlier tokens (from ``return_state=True``). Causal: token t sees the state's
        tokens and this call's s <= t. Non-causal: every token of this call sees the state's tokens
        and every token of this call (block-causal across calls).
    return_state : bool
        Also return the state after this call's tokens: ``(o, state)``.
    backend : {"auto", "numpy", "numba", "cupy"}
    chunk : int
        Chunk length of the causal algorithm (intra-chunk quadratic, carried state in between).
    decay : None, float or array of floats in (0, 1]
        gamma: a scalar or one value per k/v head (any shape that broadcasts to k's axes other than
        the sequence and last ones, e.g. (H_kv,)). ``S_t = gamma S_(t-1) + R b_t v_t^T`` and
        ``z_t = gamma z_(t-1) + b_t``. With identity features, ``normalize=False`` and
        ``1 - 2**(-5 - arange(H))`` it is RetNet's retention. Values < 1 need ``causal=True``.
    normalize : bool
        Divide by the (decayed) denominator (default) or return the numerator alone.
    cu_seqlens : integer array (N+1,), optional
        A packed batch (flash-attn's varlen convention, see :mod:`rotary.spec.packing`): q, k, v have no
        batch axis before the sequence axis (or one of size 1) and sequence n owns tokens
        ``cu_seqlens[n]:cu_seqlens[n+1]``; no token sees another sequence's, positions restart per
        sequence (at ``seqlen_offsets``, or at the state's ``next_position``), and the state is per
        sequence: S of shape (N, *k's axes after the sequence axis except the last, m, dv),
        next_position (N,).
    seqlen_offsets : integer array (N,) or int, optional
        With ``cu_seqlens``: the position of each sequence's first token.
    save_for_backward : bool
        Also return what the backward of this call can reuse, last: a causal call on a backend that keeps its
        states before each chunk (Numba) returns them (a :class:`~rotary.attn.linear_state.SavedForBackward`), which
        :func:`~rotary.attn.linear_backward.linear_attention_backward` ``(..., saved=)`` reads instead of sweeping
        k and v again (its forward sweep: ~1/8 of its work); None where there is nothing to keep (another
        backend, non-causal, packed). Memory: one (m, dv) state per chunk and k/v head, in the work dtype.

    Returns
    -------
    o or (o, state)
        ``o`` has q's array type and dtype and q's shape with last dim dv; ``(o, state)`` with
        ``return_state=True``. The state is per k/v head (see :class:`LinearAttentionState`). With
        ``save_for_backward=True``, the saved states (or None) come last: ``(o, saved)``, ``(o, state, saved)``.
    """
    if not isinstance(save_for_backward, (bool, np.bool_)):
        raise TypeError(f"save_for_backward must be a bool, got {type(save_for_backward).__name__}")
    if save_for_backward:
        return checked_call(q, k, v, positions, causal=causal, feature_map=feature_map, eps=eps, spec=spec,
                            seq_axis=seq_axis, state=state, return_state=return_state, backend=backend, chunk=chunk,
                            decay=decay, normalize=normalize, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                            spec_kwargs=spec_kwargs, save_for_backward=True)
    if (state is not None and positions is None and spec is None and decay is None and cu_seqlens is None
            and seqlen_offsets is None and not spec_kwargs):
        result = decode_step(q, k, v, seq_axis, state, causal, feature_map, eps, chunk, normalize, return_state,
                              backend)
        if result is not None:
            return result
    return checked_call(q, k, v, positions, causal=causal, feature_map=feature_map, eps=eps, spec=spec,
                        seq_axis=seq_axis, state=state, return_state=return_state, backend=backend, chunk=chunk,
                        decay=decay, normalize=normalize, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                        spec_kwargs=spec_kwargs)


def checked_call(q, k, v, positions, *, causal, feature_map, eps, spec, seq_axis, state, return_state, backend, chunk,
                 decay, normalize, cu_seqlens, seqlen_offsets, spec_kwargs, angles=None, save_for_backward=False):
    """:func:`linear_attention` after its decode fast path: the array checks, then the packed or the general
    body. ``angles``: see :func:`_linear_attention` (positions then None; not with ``cu_seqlens``).
    ``save_for_backward``: the general body appends what it saved (see :func:`linear_attention`; the packed body
    saves nothing)."""
    xp = namespace([q, k, v], ["q", "k", "v"])
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        check_float(a, name, xp)
    ax = normalize_seq_axis(seq_axis, q.ndim, "q")
    gax, groups = check_shapes(q, k, v, ax)
    if cu_seqlens is not None or seqlen_offsets is not None:
        if angles is not None:
            raise ValueError("cu_seqlens/seqlen_offsets with traced positions: pass concrete positions")
        result = _packed(xp, q, k, v, positions, ax, causal=causal, feature_map=feature_map, eps=eps, spec=spec,
                         state=state, return_state=return_state, backend=backend, chunk=chunk, decay=decay,
                         normalize=normalize, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                         spec_kwargs=spec_kwargs)
        return nothing_saved(result, return_state) if save_for_backward else result
    return _linear_attention(xp, q, k, v, positions, ax, gax, groups, causal=causal, feature_map=feature_map, eps=eps,
                             spec=spec, state=state, return_state=return_state, backend=backend, chunk=chunk,
                             decay=decay, normalize=normalize, spec_kwargs=spec_kwargs, angles=angles,
                             save_for_backward=save_for_backward)


def _linear_attention(xp, q, k, v, positions, ax, gax, groups, *, causal, feature_map, eps, spec, state, return_state,
                      backend, chunk, decay, normalize, spec_kwargs, varlen=None, angles=None, save_for_backward=False):
    """The body of :func:`linear_attention` after the array checks. ``varlen = (cu_seqlens, next_positions)``:
    a ragged packed batch of N sequences in one backend call: q, k, v are (1, T, ...) (ax = 1), positions
    per token (1, T, ...), state and decay per sequence (N, ...), cu_seqlens int64 (N + 1,).
    ``angles(spec, B, table_dtype) -> (cos, sin, rows, next_position)`` replaces the host positions, the
    table lookup and the next position (positions None): JAX traced positions (rotary.interop.jax_adapter).
    ``save_for_backward``: also return the backend's chunk states, last (a :class:`SavedForBackward`, or None)."""
    check_scalars(causal, eps, chunk, return_state, normalize)
    check_feature_map(feature_map)
    kv_other = tuple(k.shape[:ax]) + tuple(k.shape[ax + 1:-1])
    if varlen is not None:
        kv_other = (int(varlen[0].shape[0]) - 1,) + kv_other[1:]   # the state's batch: one per sequence
    decay = check_decay(decay, kv_other, causal)

    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    if callable(feature_map):
        a, b = feature_map(xp.astype(q, work)), feature_map(xp.astype(k, work))
        for x, src, name in ((a, q, "feature_map(q)"), (b, k, "feature_map(k)")):
            if type(x) is not type(src) or not xp.isdtype(x.dtype, "real floating"):
                raise TypeError(f"{name} must return a real floating array of q's type ({type(src).__name__}), got "
                                f"{type(x).__name__}{' of dtype ' + str(x.dtype) if hasattr(x, 'dtype') else ''}")
            if tuple(x.shape[:-1]) != tuple(src.shape[:-1]) or x.ndim != src.ndim:
                raise ValueError(f"{name} must have shape {tuple(src.shape[:-1])} + (m,), got {tuple(x.shape)}")
        if b.shape[-1] != a.shape[-1]:
            raise ValueError(f"feature_map(q) and feature_map(k) must have the same last dim, got "
                             f"{a.shape[-1]} and {b.shape[-1]}")
        a, b, v_in = xp.astype(a, work), xp.astype(b, work), xp.astype(v, work)
        backend_map = "identity"
    else:
        a, b, v_in, backend_map = q, k, v, feature_map
    m, dv, seq_len = int(a.shape[-1]), int(v.shape[-1]), int(q.shape[ax])
    lead_shape = tuple(q.shape[:ax])

    if state is not None and spec is None and not spec_kwargs and isinstance(state, LinearAttentionState):
        spec = state.spec
    spec = resolve_spec(spec, spec_kwargs, m, "phi(q)" if callable(feature_map) else "q")
    if state is not None:
        check_state(state, q, spec, feature_map, kv_other, m, dv, decay, normalize, groups)
        if positions is None and angles is None:
            positions = start_positions(state, lead_shape, seq_len)

    # GQA: the axis where k has fewer heads becomes the innermost canonical head axis (a view)
    perm = _gqa_permutation(q.ndim, ax, gax)
    if perm is not None:
        a, b, v_in = (xp.permute_dims(x, perm) for x in (a, b, v_in))
    wax = ax if perm is None else perm.index(ax)
    operm = _other_perm(q.ndim, ax, perm)
    kv_other_w = tuple(kv_other[i] for i in operm)
    B, _, H, _ = canonical_shape(tuple(a.shape), wax)
    Hk = canonical_shape(tuple(b.shape), wax)[2]
    Bs = B if varlen is None else kv_other[0]   # the states' batch
    pos = None if angles is not None else normalize_positions(positions, lead_shape, seq_len, canonical_batch=B,
                                                               spec=spec)

    reordered = operm != sorted(operm)   # k's other axes are not in canonical order (GQA on a middle axis)

    def to_state_layout(x, tail):
        """Canonical (B, Hk, *tail) -> k's other axes + tail."""
        x = x.reshape(kv_other_w + tail) if type(x) is np.ndarray else xp.reshape(x, kv_other_w + tail)
        if reordered:
            x = xp.permute_dims(x, tuple(int(i) for i in np.argsort(operm)) + tuple(range(len(operm), x.ndim)))
        return x

    def make_state(S, z, next_pos, step=None):
        if isinstance(next_pos, np.ndarray):
            next_pos = np.array(next_pos, dtype=np.int64)
            next_pos.setflags(write=False)
        # every field checked above (S, z: the backend's fresh work-dtype arrays of the checked shapes)
        return LinearAttentionState._trusted(to_state_layout(S, (m, dv)),
                                             to_state_layout(z, (m,)) if normalize else None, next_pos, spec,
                                             feature_map, decay, bool(normalize), int(groups), step)

    if seq_len == 0:
        dev = xp_device(q)
        o = xp.zeros((*q.shape[:-1], dv), dtype=q.dtype, device=dev)
        if save_for_backward:   # nothing to keep: the call without it, then None
            return nothing_saved(_linear_attention(
                xp, q, k, v, positions, ax, gax, groups, causal=causal, feature_map=feature_map, eps=eps, spec=spec,
                state=state, return_state=return_state, backend=backend, chunk=chunk, decay=decay, normalize=normalize,
                spec_kwargs={}, varlen=varlen, angles=angles), return_state)   # (spec: resolved above)
        if not return_state:
            return o
        if state is not None:
            return o, state
        S = xp.zeros((B, Hk, m, dv), dtype=work, device=dev)
        z = xp.zeros((B, Hk, m), dtype=work, device=dev)
        if angles is not None:
            return o, make_state(S, z, angles(spec, B, np.float32)[3])
        return o, make_state(S, z, next_position(pos, lead_shape, 0, positions, None))

    module = pick_backend([q, k, v], backend, "linear_attention")
    device_key, convert = table_converter(module, q, xp)
    table_dtype = np.float64 if q.dtype == xp.float64 else np.float32
    if angles is None:
        cos, sin, rows = _tables.lookup(spec, pos, dtype=table_dtype, device_key=device_key, convert=convert)
    else:
        cos, sin, rows, next_pos = angles(spec, B, table_dtype)
    carried = None
    if state is not None:
        def to_canonical_state(x, n_tail):
            if type(x) is np.ndarray:   # NumPy without the namespace wrappers (a decode step per token)
                x = x if x.dtype == work else x.astype(work)
            else:
                x = xp.astype(x, work, copy=False)
            if reordered:
                x = xp.permute_dims(x, tuple(operm) + tuple(range(len(operm), len(operm) + n_tail)))
            shape = (Bs, Hk) + tuple(x.shape[len(operm):])
            return x.reshape(shape) if type(x) is np.ndarray else xp.reshape(x, shape)

        carried = (to_canonical_state(state.S, 2), None if state.z is None else to_canonical_state(state.z, 1))
    decay_c = None
    if decay is not None:
        decay_c = np.ascontiguousarray(np.transpose(decay, operm)).reshape(Bs, Hk)
    a_c, b_c = canonical(a, wax, xp), canonical(b, wax, xp)
    if spec.rotary_offset:
        a_c, b_c, carried, restore = _rotated_block_first(xp, spec, m, a_c, b_c, carried, q)
    packed = {} if varlen is None else {"cu_seqlens": varlen[0]}
    keep = save_for_backward and causal and varlen is None and angles is None and not callable(feature_map) and \
        getattr(module, "LINEAR_CHUNK_STATES", False)
    if keep:
        packed["keep_chunk_states"] = True
    o, (S, z), *kept = module.linear_attention(
        a_c, b_c, canonical(v_in, wax, xp), cos, sin, rows,
        rotary_dim=spec.rotary_dim, layout=spec.layout, causal=bool(causal), feature_map=backend_map,
        eps=float(eps), chunk=int(chunk), state=carried, decay=decay_c, normalize=bool(normalize), **packed)
    saved = None
    if kept and kept[0] is not None:
        saved = SavedForBackward(module, kept[0], saved_fingerprint(k, v, chunk, causal))
    if spec.rotary_offset:
        S, z = restore(S), (None if z is None else restore(z))
    o_shape = tuple(a.shape[:-1]) + (dv,)
    o = from_canonical(o, o_shape, wax, xp)
    if perm is not None:
        o = xp.permute_dims(o, tuple(int(i) for i in np.argsort(perm)))
    if type(o) is not np.ndarray or o.dtype != q.dtype:
        o = xp.astype(o, q.dtype, copy=False)   # fresh from the backend
    last = (saved,) if save_for_backward else ()
    if not return_state:
        return (o,) + last if last else o
    if varlen is not None:
        return (o, make_state(S, z, varlen[1])) + last
    if angles is None:
        next_pos = next_position(pos, lead_shape, seq_len, positions, state)
    # the plan of a one-token call: the next token's call with this state repeats it without the checks above
    step = make_decode_step(q, k, v, ax, perm, spec, feature_map, decay, causal, normalize, backend, module, cos, sin,
                            rows, next_pos) if seq_len == 1 else None
    return (o, make_state(S, z, next_pos, step)) + last


def nothing_saved(result, return_state):
    """``result`` (o, or (o, state) with ``return_state``) with None saved for the backward appended (a call that
    keeps nothing for its backward; the torch, JAX and Dask adapters: their autograd keeps its own)."""
    return (result if return_state else (result,)) + (None,)


def _rotated_block_first(xp, spec, m, a, b, carried, like):
    """A spec with ``rotary_offset``: the backends rotate features [0, rotary_dim), so the rotated block
    moves first (``perm`` = [off, off + r), [0, off), [off + r, m)) in the canonical features and the
    carried state. A permutation of the feature axis applied to both phi(q) and phi(k) changes no dot
    product ``<R phi(q), R phi(k)>`` and no ``phi(q) . z``; ``restore`` puts the new state's feature
    axis (axis 2 of (B, Hk, m, dv) and (B, Hk, m)) back in the head's own order."""
    off, r = spec.rotary_offset, spec.rotary_dim
    perm = np.concatenate([np.arange(off, off + r), np.arange(off), np.arange(off + r, m)])
    dev = xp_device(like)
    fwd, back = xp.asarray(perm, device=dev), xp.asarray(np.argsort(perm), device=dev)
    a, b = xp.take(a, fwd, axis=3), xp.take(b, fwd, axis=3)
    if carried is not None:
        carried = tuple(None if c is None else xp.take(c, fwd, axis=2) for c in carried)
    return a, b, carried, (lambda x: xp.take(x, back, axis=2))


def _packed(xp, q, k, v, positions, ax, *, causal, feature_map, eps, spec, state, return_state, backend, chunk,
            decay, normalize, cu_seqlens, seqlen_offsets, spec_kwargs):
    """linear_attention over a packed batch: one state per sequence, no token sees another sequence.

    The packed (1.., T, rest) arrays are seen as a batch of sequences: equal lengths as one call on
    (N, L, rest) with per-batch positions; ragged lengths as one backend call on (1, T, rest) with
    ``cu_seqlens`` (every built-in backend; a backend without ``PACKED_LINEAR_ATTENTION``: one call per
    sequence on (1, L_n, rest)).
    """
    if cu_seqlens is None:
        raise ValueError("seqlen_offsets needs cu_seqlens (one offset per packed sequence)")
    check_scalars(causal, eps, chunk, return_state, normalize)
    if state is not None and not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a rotary.LinearAttentionState or None, got {type(state).__name__}")
    if state is not None and spec is None and not spec_kwargs:
        spec = state.spec
    if state is not None:
        N = int(np.size(to_numpy(cu_seqlens, "cu_seqlens"))) - 1
        if not isinstance(state.next_position, np.ndarray) or state.next_position.shape != (N,):
            raise ValueError(f"state has next_position {state.next_position!r}; a packed call needs a state of "
                             f"{N} sequences (from a call with cu_seqlens of {N} sequences)")
        if tuple(state.S.shape[:1]) != (N,):
            raise ValueError(f"state has S of shape {tuple(state.S.shape)}; this call packs {N} sequences")
        if positions is None and seqlen_offsets is None:
            seqlen_offsets = state.next_position
    positions, packed = packed_positions(q, ax, positions, cu_seqlens, seqlen_offsets, "q",
                                         spec if isinstance(spec, RopeSpec) else None)
    positions = np.asarray(to_numpy(positions, "positions"))
    if positions.shape[:1] != (q.shape[ax],):
        raise ValueError(f"positions with cu_seqlens must be per token, shape ({q.shape[ax]}, ...), got "
                         f"{positions.shape}")
    N = packed.n_seqs
    rest_q, rest_k, rest_v = tuple(q.shape[ax + 1:]), tuple(k.shape[ax + 1:]), tuple(v.shape[ax + 1:])
    heads_k = (N,) + tuple(k.shape[ax + 1:-1])
    decay_full = check_decay(decay, heads_k, causal)
    kw = dict(causal=causal, feature_map=feature_map, eps=eps, spec=spec, seq_axis=1, backend=backend, chunk=chunk,
              normalize=normalize, return_state=True, **spec_kwargs)
    lengths = packed.lengths
    pieces, states = [], []
    if N and not np.all(lengths == lengths[0]) and getattr(pick_backend([q, k, v], backend, "linear_attention"),
                                                           "PACKED_LINEAR_ATTENTION", False):
        return _ragged(xp, q, k, v, positions, ax, packed, causal=causal, feature_map=feature_map, eps=eps,
                       spec=spec, state=state, return_state=return_state, backend=backend, chunk=chunk,
                       decay=decay_full, normalize=normalize, spec_kwargs=spec_kwargs)
    if N and np.all(lengths == lengths[0]):
        L = int(lengths[0])
        groups = [(0, N, L)]
    else:
        groups = [(n, n + 1, int(lengths[n])) for n in range(N)]
    for n0, n1, L in groups:
        t0, t1 = int(packed.cu_seqlens[n0]), int(packed.cu_seqlens[n1])
        sl = (slice(None),) * ax + (slice(t0, t1),)
        qs, ks, vs = (xp.reshape(a[sl], (n1 - n0, L) + r) for a, r in ((q, rest_q), (k, rest_k), (v, rest_v)))
        pos = positions[t0:t1].reshape((n1 - n0, L) + positions.shape[1:])
        sub_state = None
        if state is not None:
            sub_state = LinearAttentionState(
                state.S[n0:n1], None if state.z is None else state.z[n0:n1], state.next_position[n0:n1],
                spec=state.spec, feature_map=state.feature_map,
                decay=None if state.decay is None else state.decay[n0:n1], normalize=state.normalize,
                groups=state.groups)
        o, st = linear_attention(qs, ks, vs, pos, state=sub_state,
                                 decay=None if decay_full is None else decay_full[n0:n1], **kw)
        pieces.append(xp.reshape(o, tuple(q.shape[:ax]) + (t1 - t0,) + rest_q[:-1] + (v.shape[-1],)))
        states.append(st)
    if pieces:
        o = pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=ax)
    else:
        o = xp.zeros(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype, device=xp_device(q))
    if not return_state:
        return o
    if not states:   # no sequences
        raise ValueError("cu_seqlens with return_state=True needs at least one sequence")
    S = states[0].S if len(states) == 1 else xp.concat([st.S for st in states], axis=0)
    z = None if not normalize else (states[0].z if len(states) == 1 else xp.concat([st.z for st in states], axis=0))
    nxt = np.concatenate([np.broadcast_to(np.asarray(st.next_position, np.int64), (n1 - n0,)) if L else
                          packed.offsets[n0:n1] for st, (n0, n1, L) in zip(states, groups)])
    return o, LinearAttentionState(S, z, nxt, spec=states[0].spec, feature_map=feature_map, decay=decay_full,
                                   normalize=normalize, groups=states[0].groups)


def _ragged(xp, q, k, v, positions, ax, packed, *, causal, feature_map, eps, spec, state, return_state, backend,
            chunk, decay, normalize, spec_kwargs):
    """A packed batch of different lengths in one backend call: the arrays as (1, T, rest) with cu_seqlens,
    positions per token, state and decay per sequence; next_position per sequence (an empty sequence keeps
    its offset)."""
    T = int(q.shape[ax])
    q1, k1, v1 = (xp.reshape(a, (1, T) + tuple(a.shape[ax + 1:])) for a in (q, k, v))
    gax, groups = check_shapes(q1, k1, v1, 1)
    cu = np.ascontiguousarray(packed.cu_seqlens, dtype=np.int64)
    nxt = np.array(packed.offsets, dtype=np.int64).reshape(-1)
    for n in range(packed.n_seqs):
        t0, t1 = int(cu[n]), int(cu[n + 1])
        if t1 > t0:
            nxt[n] = next_position(positions[t0:t1][None], (1,), t1 - t0, None, None)
    out = _linear_attention(xp, q1, k1, v1, positions[None], 1, gax, groups, causal=causal, feature_map=feature_map,
                            eps=eps, spec=spec, state=state, return_state=return_state, backend=backend,
                            chunk=chunk, decay=decay, normalize=normalize, spec_kwargs=spec_kwargs, varlen=(cu, nxt))
    o = out[0] if return_state else out
    o = xp.reshape(o, tuple(q.shape[:-1]) + (v.shape[-1],))
    return (o, out[1]) if return_state else o

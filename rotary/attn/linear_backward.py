"""The backward of :func:`rotary.linear_attention`: dq, dk, dv (and the gradient at a carried state) from dL/do.

``linear_attention_backward(q, k, v, grad_o, positions, **the forward's keywords, grad_state=None)`` checks its
arguments as the forward does, builds the same cos/sin tables, rows and canonical views, and calls the backend's
``linear_attention_backward`` primitive (contract in ``rotary.backends``; formulas in
:mod:`rotary.backends.numpy_linear_backward`), picked by capability: a backend without it under
``backend="auto"`` falls back to the NumPy reference, which takes any array-API array (torch, CuPy, JAX
included). With a = phi(q), b = phi(k), â, b̂ rotated, g = grad_o::

    dv_s = P_s^T b̂_s,  db_s = R_s^T (P_s v_s) + Q_s,  da_t = R_t^T (S_t gN_t) + gD_t z_t
    dq = phi'(q) da,  dk = phi'(k) db

with gN_t = g_t / (a_t.z_t + eps), gD_t = -(gN_t . N_t) / (a_t.z_t + eps) (normalize=False: gN = g, gD = 0) and
P_s, Q_s the gradients at the running state (S_s, z_s) from the tokens >= s and ``grad_state``.

Not covered: a callable feature map (apply it yourself, pass ``feature_map="identity"`` and chain its
gradient), packed batches (``cu_seqlens``): both raise an error naming the argument. The backward is not
itself differentiable (no double backward).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import device as xp_device

from ..frontend import dispatch as _adapters
from ..frontend.normalize import (canonical, canonical_shape, check_float, from_canonical, namespace,
                                  normalize_positions, normalize_seq_axis, pick_backend, resolve_spec,
                                  start_positions, table_converter)
from ..spec import tables as _tables
from .linear import _gqa_permutation, _other_perm, _rotated_block_first
from .linear_args import check_decay, check_scalars, check_shapes
from .linear_state import LinearAttentionState, SavedForBackward, check_feature_map, check_state, saved_fingerprint


@_adapters.dispatch("linear_attention_backward", 4)   # Dask: rotary/interop/dask_adapter.py
def linear_attention_backward(q, k, v, grad_o, positions=None, *, causal=False, feature_map="elu", eps=1e-6,
                              spec=None, seq_axis=None, state=None, return_state=False, backend="auto", chunk=64,
                              decay=None, normalize=True, cu_seqlens=None, seqlen_offsets=None, grad_state=None,
                              saved=None, **spec_kwargs):
    """Gradients of :func:`rotary.linear_attention` (same arguments) given ``grad_o`` = dL/do (o's shape).

    ``grad_state``: None, or ``(G_S, G_z)``, dL/d of the state the forward returns (``state.S``'s and
    ``state.z``'s shapes; either None: zeros), for training over segments with a carried state.
    ``return_state`` is accepted for symmetry with the forward and changes nothing. ``saved``: what the forward of
    these arrays kept (``linear_attention(..., save_for_backward=True)``, or None): the backend that made it reads
    its chunk states instead of sweeping k and v again (another backend ignores them); the same results.

    Returns ``(dq, dk, dv, dstate)``: dq, dk, dv with q's, k's, v's shapes and dtypes and array type;
    ``dstate`` is None without ``state``, else ``(dS, dz)`` with ``state.S``'s and ``state.z``'s shapes in the
    work dtype (dz None when ``state.z`` is None, i.e. ``normalize=False``). The backward is not differentiable
    again (double backward is unsupported).
    """
    del return_state
    xp = namespace([q, k, v, grad_o], ["q", "k", "v", "grad_o"])
    for a, name in ((q, "q"), (k, "k"), (v, "v"), (grad_o, "grad_o")):
        check_float(a, name, xp)
    if cu_seqlens is not None or seqlen_offsets is not None:
        raise NotImplementedError("linear_attention_backward does not take cu_seqlens/seqlen_offsets (packed "
                                  "batches) yet: call it per sequence, or on a padded batch")
    ax = normalize_seq_axis(seq_axis, q.ndim, "q")
    gax, groups = check_shapes(q, k, v, ax)
    check_scalars(causal, eps, chunk, False, normalize)
    check_feature_map(feature_map)
    if callable(feature_map):
        raise TypeError("linear_attention_backward takes a named feature_map ('elu', 'relu', 'identity'); for a "
                        "callable, pass its outputs with feature_map='identity' and chain its gradient yourself")
    dv_dim = int(v.shape[-1])
    o_shape = tuple(q.shape[:-1]) + (dv_dim,)
    if tuple(grad_o.shape) != o_shape:
        raise ValueError(f"grad_o must have the output's shape {o_shape}, got {tuple(grad_o.shape)}")
    kv_other = tuple(k.shape[:ax]) + tuple(k.shape[ax + 1:-1])
    decay = check_decay(decay, kv_other, causal)
    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    m, seq_len = int(q.shape[-1]), int(q.shape[ax])
    lead_shape = tuple(q.shape[:ax])
    if state is not None and spec is None and not spec_kwargs and isinstance(state, LinearAttentionState):
        spec = state.spec
    spec = resolve_spec(spec, spec_kwargs, m, "q")
    if state is not None:
        check_state(state, q, spec, feature_map, kv_other, m, dv_dim, decay, normalize, groups)
        if positions is None:
            positions = start_positions(state, lead_shape, seq_len)
    grad_S, grad_z = _check_grad_state(grad_state, xp, kv_other, m, dv_dim, normalize)
    if saved is not None:
        if not isinstance(saved, SavedForBackward):
            raise TypeError(f"saved must be what linear_attention(..., save_for_backward=True) returned last (or "
                            f"None), got {type(saved).__name__}")
        if saved.inputs != saved_fingerprint(k, v, chunk, causal):
            raise ValueError("saved belongs to another forward: the states it holds are those of other k, v (their "
                             "memory, shapes or strides), another chunk or causal setting than this call's")

    perm = _gqa_permutation(q.ndim, ax, gax)   # the GQA axis as the innermost canonical head axis (a view)
    a, b, v_in, go = (q, k, v, grad_o) if perm is None else (xp.permute_dims(x, perm) for x in (q, k, v, grad_o))
    wax = ax if perm is None else perm.index(ax)
    operm = _other_perm(q.ndim, ax, perm)
    kv_other_w = tuple(kv_other[i] for i in operm)
    reordered = operm != sorted(operm)
    B = canonical_shape(tuple(a.shape), wax)[0]
    Hk = canonical_shape(tuple(b.shape), wax)[2]

    def canonical_state(x, n_tail):
        """k's other axes + tail -> (B, Hk, *tail) in the work dtype."""
        x = xp.astype(x, work)
        if reordered:
            x = xp.permute_dims(x, tuple(operm) + tuple(range(len(operm), len(operm) + n_tail)))
        return xp.reshape(x, (B, Hk) + tuple(x.shape[len(operm):]))

    def state_layout(x, tail):
        """(B, Hk, *tail) -> k's other axes + tail."""
        x = xp.reshape(x, kv_other_w + tail)
        if reordered:
            x = xp.permute_dims(x, tuple(int(i) for i in np.argsort(operm)) + tuple(range(len(operm), x.ndim)))
        return x

    def back(d, like, shape):
        """A canonical gradient -> ``like``'s shape, axes and dtype."""
        d = from_canonical(d, shape, wax, xp)
        if perm is not None:
            d = xp.permute_dims(d, tuple(int(i) for i in np.argsort(perm)))
        return xp.astype(d, like.dtype, copy=False)   # (the backends' fresh arrays: no copy in like's dtype)

    if seq_len == 0:
        dev = xp_device(q)
        grads = tuple(xp.zeros(tuple(x.shape), dtype=x.dtype, device=dev) for x in (q, k, v))
        if state is None:
            return grads + (None,)
        dS = xp.zeros((*kv_other, m, dv_dim), dtype=work, device=dev) if grad_S is None else xp.astype(grad_S, work)
        dz = None
        if state.z is not None:
            dz = xp.zeros((*kv_other, m), dtype=work, device=dev) if grad_z is None else xp.astype(grad_z, work)
        return grads + ((dS, dz),)

    pos = normalize_positions(positions, lead_shape, seq_len, canonical_batch=B, spec=spec)
    module = pick_backend([q, k, v], backend, "linear_attention_backward")
    device_key, convert = table_converter(module, q, xp)
    table_dtype = np.float64 if q.dtype == xp.float64 else np.float32
    cos, sin, rows = _tables.lookup(spec, pos, dtype=table_dtype, device_key=device_key, convert=convert)
    carried = None
    if state is not None:
        carried = (canonical_state(state.S, 2), None if state.z is None else canonical_state(state.z, 1))
    g_state = None
    if grad_S is not None or grad_z is not None:
        g_state = (None if grad_S is None else canonical_state(grad_S, 2),
                   None if grad_z is None else canonical_state(grad_z, 1))
    decay_c = None if decay is None else np.ascontiguousarray(np.transpose(decay, operm)).reshape(B, Hk)
    a_c, b_c = canonical(a, wax, xp), canonical(b, wax, xp)
    restore = None
    if spec.rotary_offset:   # the rotated block first in the features, the state and its gradient (see linear.py)
        both = (carried or (None, None)) + (g_state or (None, None))
        a_c, b_c, both, restore = _rotated_block_first(xp, spec, m, a_c, b_c, both, q)
        carried = None if carried is None else both[:2]
        g_state = None if g_state is None else both[2:]
    kept = {} if saved is None or saved.module is not module else {"chunk_states": saved.states}
    dq, dk, dv, dstate = module.linear_attention_backward(
        a_c, b_c, canonical(v_in, wax, xp), cos, sin, rows, canonical(go, wax, xp),
        rotary_dim=spec.rotary_dim, layout=spec.layout, causal=bool(causal), feature_map=feature_map,
        eps=float(eps), chunk=int(chunk), state=carried, decay=decay_c, normalize=bool(normalize),
        grad_state=g_state, **kept)
    if restore is not None:   # the features' own order: axis 3 of the canonical gradients, axis 2 of the state's
        dq, dk = (xp.permute_dims(restore(xp.permute_dims(d, (0, 1, 3, 2))), (0, 1, 3, 2)) for d in (dq, dk))
        if dstate is not None:
            dstate = tuple(None if d is None else restore(d) for d in dstate)
    grads = (back(dq, q, tuple(a.shape)), back(dk, k, tuple(b.shape)), back(dv, v, tuple(v_in.shape)))
    if state is None:
        return grads + (None,)
    dS = state_layout(dstate[0], (m, dv_dim))
    dz = None if state.z is None else state_layout(dstate[1], (m,))
    return grads + ((dS, dz),)


def _check_grad_state(grad_state, xp, kv_other, m, dv, normalize):
    """(G_S, G_z) of ``grad_state`` (None: zeros), shapes checked against the state the forward returns."""
    if grad_state is None:
        return None, None
    if isinstance(grad_state, LinearAttentionState):
        grad_state = (grad_state.S, grad_state.z)
    if not isinstance(grad_state, (tuple, list)) or len(grad_state) != 2:
        raise TypeError("grad_state must be None or a pair (G_S, G_z) of arrays (either None), the gradient at "
                        f"the returned state's S and z; got {type(grad_state).__name__}")
    gS, gz = grad_state
    for x, shape, name in ((gS, (*kv_other, m, dv), "grad_state[0] (dL/dS)"), (gz, (*kv_other, m),
                                                                               "grad_state[1] (dL/dz)")):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have the returned state's shape {shape}, got {tuple(x.shape)}")
    if gz is not None and not normalize:
        raise ValueError("grad_state[1] (dL/dz) is given, but normalize=False returns a state without z: pass None")
    return gS, gz

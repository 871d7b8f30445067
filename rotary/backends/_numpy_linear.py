"""Reference linear attention with RoPE in the numerator (RoFormer eq. 19); any array-API namespace.

With a = phi(q), b = phi(k), â = R_p a, b̂ = R_p b (rotation per layout/rotary_dim)::

    o_t = (â_t · (S0 + sum_s b̂_s v_s^T)) / (a_t · (z0 + sum_s b_s) + eps)

s over all tokens (non-causal) or s <= t (causal). Non-causal: one reduction (S, z) then one
readout, O(T m dv). Causal: chunks of C rows; per chunk the intra-chunk masked quadratic
``tril(Â_c B̂_c^T) V_c`` plus the carried state ``Â_c S``, the denominator from a row cumsum of
B_c plus the carried z; then ``S += B̂_c^T V_c``, ``z += sum B_c``. Features and rotations are made
chunk by chunk too, so temporaries are chunk-sized: never a T x T matrix, never a T x m x dv tensor.
Sums are blocked per chunk in the work dtype (float32, float64 for float64 input). All array
operations are functional (no in-place writes), so JAX arrays work too.
"""

from __future__ import annotations

from array_api_compat import array_namespace, device as xp_device, is_numpy_array

from .numpy import _compute_dtype, _rotate_xp, gather_rows

FEATURE_MAPS = ("elu", "relu", "identity")


def _feature_map(xp, x, name):
    """phi(x): elu(x) + 1 = exp(min(x, 0)) + max(x, 0), max(x, 0) or x."""
    zero = xp.zeros((), dtype=x.dtype, device=xp_device(x))
    if name == "elu":
        return xp.exp(xp.minimum(x, zero)) + xp.maximum(x, zero)
    if name == "relu":
        return xp.maximum(x, zero)
    if name == "identity":
        return x
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {name!r}")


def _heads_first(xp, x):
    """(B, n, H, D) -> (B, H, n, D); a contiguous copy for NumPy so that the matmuls hit BLAS."""
    y = xp.permute_dims(x, (0, 2, 1, 3))
    if is_numpy_array(y):
        import numpy as np

        y = np.ascontiguousarray(y)
    return y


def linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state):
    """(o, (S, z)) for canonical q, k (B, S, H, m), v (B, S, H, dv); see the module docstring."""
    xp = array_namespace(q, k, v)
    dev = xp_device(q)
    work = _compute_dtype(q.dtype, xp)
    B, T, H, m = q.shape
    dv = v.shape[-1]
    cos_tok, sin_tok = gather_rows(xp, cos, sin, rows, work, False)                  # (Bp, T, 1, half)
    cos_tok = xp.permute_dims(cos_tok, (0, 2, 1, 3))                                 # (Bp, 1, T, half)
    sin_tok = xp.permute_dims(sin_tok, (0, 2, 1, 3))

    def features(x, s0, s1):
        """(phi(x), R_p phi(x)) of tokens s0:s1, heads first: (B, H, n, m) in the work dtype."""
        f = _feature_map(xp, _heads_first(xp, xp.astype(x[:, s0:s1, ...], work, copy=False)), feature_map)
        return f, _rotate_xp(xp, f, cos_tok[:, :, s0:s1, ...], sin_tok[:, :, s0:s1, ...], rotary_dim, layout)

    def values(s0, s1):
        return _heads_first(xp, xp.astype(v[:, s0:s1, ...], work, copy=False))       # (B, H, n, dv)

    if state is None:
        S = xp.zeros((B, H, m, dv), dtype=work, device=dev)
        z = xp.zeros((B, H, m), dtype=work, device=dev)
    else:
        S, z = (xp.astype(s, work, copy=False) for s in state)
    step = max(1, int(chunk))
    bounds = [(s0, min(T, s0 + step)) for s0 in range(0, T, step)]
    pieces = []
    if not causal:
        for s0, s1 in bounds:                       # reduce: S += B̂_c^T V_c, z += sum B_c
            bc, bhat = features(k, s0, s1)
            S = S + xp.matmul(xp.matrix_transpose(bhat), values(s0, s1))
            z = z + xp.sum(bc, axis=-2)
        for s0, s1 in bounds:                       # read out: Â_c S / (A_c z + eps)
            ac, ahat = features(q, s0, s1)
            den = xp.sum(ac * z[:, :, None, :], axis=-1, keepdims=True)
            pieces.append(xp.matmul(ahat, S) / (den + eps))
    else:
        idx = xp.arange(max(1, min(step, T)), device=dev)
        tril = idx[:, None] >= idx[None, :]
        zero = xp.zeros((), dtype=work, device=dev)
        for s0, s1 in bounds:
            n = s1 - s0
            (ac, ahat), (bc, bhat), vc = features(q, s0, s1), features(k, s0, s1), values(s0, s1)
            scores = xp.where(tril[:n, :n], xp.matmul(ahat, xp.matrix_transpose(bhat)), zero)
            num = xp.matmul(ahat, S) + xp.matmul(scores, vc)
            z_rows = z[:, :, None, :] + xp.cumulative_sum(bc, axis=-2)                # z after each row
            den = xp.sum(ac * z_rows, axis=-1, keepdims=True)
            pieces.append(num / (den + eps))
            S = S + xp.matmul(xp.matrix_transpose(bhat), vc)
            z = z_rows[:, :, -1, :]
    o = xp.concat(pieces, axis=-2) if pieces else xp.zeros((B, H, 0, dv), dtype=work, device=dev)
    o = xp.astype(xp.permute_dims(o, (0, 2, 1, 3)), q.dtype)                        # (B, T, H, dv)
    return o, (S, z)

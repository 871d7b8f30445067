"""Reference linear attention with RoPE in the numerator (RoFormer eq. 19); any array-API namespace.

With a = phi(q), b = phi(k), â = R_p a, b̂ = R_p b (rotation per layout/rotary_dim)::

    o_t = (â_t · (S0 + sum_s b̂_s v_s^T)) / (a_t · (z0 + sum_s b_s) + eps)

s over all tokens (non-causal) or s <= t (causal). Non-causal: one reduction (S, z) then one
readout, O(T m dv). Causal: chunks of C rows; per chunk the intra-chunk masked quadratic
``tril(Â_c B̂_c^T) V_c`` plus the carried state ``Â_c S``, the denominator from a row cumsum of
B_c plus the carried z; then ``S += B̂_c^T V_c``, ``z += sum B_c``. Never a T x T matrix, never a
T x m x dv tensor; states are summed chunk by chunk in the work dtype (float32, float64 for float64).
All array operations are functional (no in-place writes), so JAX arrays work too.
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
    """(B, S, H, D) -> (B, H, S, D); a contiguous copy for NumPy so that per-chunk matmuls hit BLAS."""
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

    a = _heads_first(xp, _feature_map(xp, xp.astype(q, work), feature_map))       # (B, H, T, m)
    b = _heads_first(xp, _feature_map(xp, xp.astype(k, work), feature_map))
    vw = _heads_first(xp, xp.astype(v, work))                                        # (B, H, T, dv)
    cos_tok, sin_tok = gather_rows(xp, cos, sin, rows, work, False)                  # (Bp, T, 1, half)
    cos_tok = xp.permute_dims(cos_tok, (0, 2, 1, 3))                                 # (Bp, 1, T, half)
    sin_tok = xp.permute_dims(sin_tok, (0, 2, 1, 3))
    a_rot = _rotate_xp(xp, a, cos_tok, sin_tok, rotary_dim, layout)
    b_rot = _rotate_xp(xp, b, cos_tok, sin_tok, rotary_dim, layout)

    if state is None:
        S = xp.zeros((B, H, m, dv), dtype=work, device=dev)
        z = xp.zeros((B, H, m), dtype=work, device=dev)
    else:
        S, z = (xp.astype(s, work, copy=False) for s in state)
    step = max(1, int(chunk))

    if not causal:
        for s0 in range(0, T, step):
            s1 = min(T, s0 + step)
            S = S + xp.matmul(xp.matrix_transpose(b_rot[:, :, s0:s1, :]), vw[:, :, s0:s1, :])
            z = z + xp.sum(b[:, :, s0:s1, :], axis=-2)
        num = xp.matmul(a_rot, S)                                                    # (B, H, T, dv)
        den = xp.sum(a * z[:, :, None, :], axis=-1, keepdims=True)                   # (B, H, T, 1)
        o = num / (den + eps)
    else:
        idx = xp.arange(max(1, min(step, T)), device=dev)
        tril = idx[:, None] >= idx[None, :]
        zero = xp.zeros((), dtype=work, device=dev)
        pieces = []
        for s0 in range(0, T, step):
            s1 = min(T, s0 + step)
            n = s1 - s0
            ac, bc, ahat, bhat, vc = (x[:, :, s0:s1, :] for x in (a, b, a_rot, b_rot, vw))
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

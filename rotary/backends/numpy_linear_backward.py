"""Reference backward of linear attention with RoPE in the numerator (RoFormer eq. 19); any array-API namespace.

Per (batch, k/v head), with a = phi(q), b = phi(k), â_t = R_t a_t, b̂_s = R_s b_s (R_t: the rotation of
token t's table row, attention scaling included, on features [0, rotary_dim)), gamma the head's decay (1
without), S0, z0 the carried state (zeros without)::

    S_t = gamma^(t+1) S0 + sum_{s<=t} gamma^(t-s) b̂_s v_s^T        z_t = gamma^(t+1) z0 + sum_{s<=t} gamma^(t-s) b_s
    N_t = â_t^T S_t        D_t = a_t . z_t        o_t = N_t / (D_t + eps)   (normalize=False: o_t = N_t)

(causal; non-causal: every S_t, z_t is S0 + sum_s b̂_s v_s^T, z0 + sum_s b_s, gamma = 1). The returned
state is (S_(T-1), z_(T-1)). With g_t = dL/do_t, and (G_S, G_z) = ``grad_state``, dL/d(S_out, z_out)::

    gN_t = g_t / (D_t + eps)      gD_t = -(gN_t . N_t) / (D_t + eps)      (normalize=False: gN_t = g_t, gD_t = 0)
    P_t = gamma P_(t+1) + sum_h â_t gN_t^T,   Q_t = gamma Q_(t+1) + sum_h gD_t a_t,   gamma P_T = G_S, gamma Q_T = G_z
    dâ_t = S_t gN_t          da_t = R_t^T dâ_t + gD_t z_t
    db̂_s = P_s v_s          db_s = R_s^T db̂_s + Q_s          dv_s = P_s^T b̂_s
    dS0 = gamma P_0,  dz0 = gamma Q_0   (P_s, Q_s: dL/dS_s, dL/dz_s from tokens >= s and the state out)
    dq = phi'(q) da,  dk = phi'(k) db    (phi' of elu + 1: 1 for x > 0, else phi(x); relu: [x > 0]; identity: 1)

sum_h over the G q heads that read the k/v head (GQA: k, v, S, z and their gradients are per k/v head).
Non-causal: P = G_S + sum_t â_t gN_t^T and Q = G_z + sum_t gD_t a_t for every s, dS0 = P, dz0 = Q.

Chunked as the forward (chunks of C rows, relative powers gamma^(i-j), gamma^(i+1), gamma^(n-1-j),
gamma^n only): a forward sweep keeps the state before each chunk ((T / C) states per head), then a
reverse sweep recomputes the chunk's features, N and D, and with the reverse state (P, Q) after the
chunk forms, W = tril(gN V^T) . Gamma (C x C)::

    dÂ = gamma^(i+1) gN S_in^T + W B̂        dB̂ = sum_h W^T Â + gamma^(n-1-j) V P^T
    dV = sum_h tril(Â B̂^T . Gamma)^T gN + gamma^(n-1-j) B̂ P
    P <- gamma^n P + sum_h Â^T (gamma^(i+1) gN),  likewise Q with gD A

Temporaries are chunk-sized (never a T x T matrix; C x C blocks per chunk). Sums are in the work dtype
(float32, float64 for float64 input). A zero denominator (eps = 0) gives NaN in o and NaN gradients, as
autograd of the quadratic form does. All operations are functional (JAX arrays work).
"""

from __future__ import annotations

from array_api_compat import array_namespace, device as xp_device

from .array_api import _compute_dtype, _rotate_xp, gather_rows
from .feature_maps import NAMES
from .numpy_linear import _feature_map, decay_powers


def _phi_and_slope(xp, x, name):
    """(phi(x), phi'(x)) in x's dtype (elu + 1: 1 for x > 0, else phi(x); relu: [x > 0]; identity: 1)."""
    f = _feature_map(xp, x, name)
    one = xp.ones((), dtype=x.dtype, device=xp_device(x))
    if name == "identity":
        return f, None
    if name == "elu":
        return f, xp.where(x > 0, one, f)
    return f, xp.where(x > 0, one, xp.zeros((), dtype=x.dtype, device=xp_device(x)))


def _chunk_weights(xp, pw64, n, host, dev):
    """Decay weights of a chunk of n rows, shaped for (B, Hk, G, n, .) arrays: Gamma (B, Hk, 1, n, n) with
    gamma^(i-j) for j <= i else 0, inter gamma^(i+1) (B, Hk, 1, n, 1), tail gamma^(n-1-j) (B, Hk, 1, n, 1),
    keep gamma^n (B, Hk, 1, 1, 1); pw64 the float64 (B, Hk, >n) powers gamma^j."""
    import numpy as np

    i = np.arange(n)
    gam = np.where(i[:, None] >= i[None, :], pw64[..., np.abs(i[:, None] - i[None, :])], 0.0)
    inter = pw64[..., 1:n + 1]
    tail = pw64[..., n - 1 - i]
    keep = pw64[..., n:n + 1]
    put = (lambda a: xp.asarray(np.ascontiguousarray(a).astype(host), device=dev))
    return (put(gam[:, :, None]), put(inter[:, :, None, :, None]), put(tail[:, :, None, :, None]),
            put(keep[:, :, None, :, None]))


def check_backward_args(q, k, v, grad_o, *, feature_map, causal, decay) -> bool:
    """The backward's refusals, one copy for every backend (NumPy, Numba, CUDA): the feature map's name, q's heads
    a multiple of k's, grad_o shaped as o, a decay < 1 only when causal. Returns whether a decay < 1 is in effect."""
    import numpy as np

    if feature_map not in NAMES:
        raise ValueError(f"feature_map must be one of {NAMES}, got {feature_map!r}")
    B, T, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    if Hk == 0 or H % Hk:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's ({Hk})")
    if tuple(grad_o.shape) != (B, T, H, dv):
        raise ValueError(f"grad_o must have o's shape {(B, T, H, dv)}, got {tuple(grad_o.shape)}")
    decayed = decay is not None and bool(np.any(np.asarray(decay) != 1))
    if decayed and not causal:
        raise ValueError("decay < 1 needs causal=True (as the forward)")
    return decayed


def linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps, chunk,
                              state, decay=None, normalize=True, grad_state=None):
    """(dq, dk, dv, dstate) of the ``linear_attention`` primitive; formulas in the module docstring.

    q (B, T, H, m), k (B, T, Hk, m), v (B, T, Hk, dv), grad_o (B, T, H, dv) (dL/do), H = G Hk; cos, sin,
    rows, state (S0 (B, Hk, m, dv), z0 (B, Hk, m) or None), decay ((B, Hk) float64 host, causal only) as
    for the forward. ``grad_state``: None or (G_S, G_z), dL/d of the returned state (either None: zeros).
    Returns dq, dk, dv in q's, k's, v's dtypes and dstate = (dS0, dz0) in the work dtype (dz0 also when z0
    was None: the gradient at the zeros used), None when ``state`` is None. Inputs are never written.
    """
    import numpy as np

    decay = np.asarray(decay, np.float64) if check_backward_args(q, k, v, grad_o, feature_map=feature_map,
                                                                 causal=causal, decay=decay) else None
    xp = array_namespace(q, k, v, grad_o)
    dev = xp_device(q)
    work = _compute_dtype(q.dtype, xp)
    host = np.float64 if work == xp.float64 else np.float32
    B, T, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    G = H // Hk

    def zeros(shape):
        return xp.zeros(shape, dtype=work, device=dev)

    def grouped(x, groups):
        """(B, T, h, c) -> (B, h / groups, groups, T, c) in the work dtype (q heads grouped by k/v head)."""
        x = xp.permute_dims(xp.astype(x, work), (0, 2, 1, 3))
        return xp.reshape(x, (B, x.shape[1] // groups, groups, T, x.shape[3]))

    def ungrouped(x, dtype):
        """(B, h, g, T, c) -> (B, T, h g, c) in ``dtype``."""
        x = xp.reshape(x, (B, x.shape[1] * x.shape[2], T, x.shape[4]))
        return xp.astype(xp.permute_dims(x, (0, 2, 1, 3)), dtype)

    qg, kg, vg, gog = grouped(q, G), grouped(k, 1), grouped(v, 1), grouped(grad_o, G)
    cos_tok, sin_tok = gather_rows(xp, cos, sin, rows, work, False)                     # (Bp, T, 1, half)
    bp = cos_tok.shape[0]
    cos_tok = xp.reshape(xp.permute_dims(cos_tok, (0, 2, 1, 3)), (bp, 1, 1, T, cos_tok.shape[-1]))
    sin_tok = xp.reshape(xp.permute_dims(sin_tok, (0, 2, 1, 3)), (bp, 1, 1, T, sin_tok.shape[-1]))

    def rot(x, s0, s1, transpose=False):
        s = sin_tok[..., s0:s1, :]
        return _rotate_xp(xp, x, cos_tok[..., s0:s1, :], -s if transpose else s, rotary_dim, layout)

    def features(x, s0, s1):
        """(phi(x), phi'(x), R phi(x)) of rows s0:s1 of a grouped (B, h, g, T, m) array."""
        f, slope = _phi_and_slope(xp, x[..., s0:s1, :], feature_map)
        return f, slope, rot(f, s0, s1)

    if state is None:
        S0, z0 = zeros((B, Hk, m, dv)), zeros((B, Hk, m))
    else:
        S0 = xp.astype(state[0], work)
        z0 = zeros((B, Hk, m)) if state[1] is None else xp.astype(state[1], work)
    gS, gz = (None, None) if grad_state is None else grad_state
    P = zeros((B, Hk, 1, m, dv)) if gS is None else xp.reshape(xp.astype(gS, work), (B, Hk, 1, m, dv))
    Q = zeros((B, Hk, 1, m)) if gz is None else xp.reshape(xp.astype(gz, work), (B, Hk, 1, m))
    S = xp.reshape(S0, (B, Hk, 1, m, dv))
    z = xp.reshape(z0, (B, Hk, 1, m))

    step = max(1, min(int(chunk), T))
    bounds = [(s0, min(T, s0 + step)) for s0 in range(0, T, step)]
    mT = xp.matrix_transpose

    def gsum(x):
        """Sum over the q heads of a group (axis 2), kept as a size-1 axis."""
        return x if G == 1 else xp.sum(x, axis=2, keepdims=True)

    def output_grads(ac, go, num, z_rows):
        """(gN, gD) of rows with numerator ``num`` and denominator a . z_rows + eps (gD None: normalize=False)."""
        if not normalize:
            return go, None
        den = xp.sum(ac * z_rows, axis=-1) + eps                                    # (B, Hk, G, n)
        gN = go / den[..., None]
        return gN, -xp.sum(gN * num, axis=-1) / den

    dq_parts, dk_parts, dv_parts = [], [], []
    if not causal:
        for s0, s1 in bounds:                                                        # the state over all tokens
            bc, _, bhat = features(kg, s0, s1)
            S = S + mT(bhat) @ vg[..., s0:s1, :]
            z = z + xp.sum(bc, axis=-2)
        for s0, s1 in bounds:                                                        # queries: dq, (P, Q)
            ac, slope, ahat = features(qg, s0, s1)
            go = gog[..., s0:s1, :]
            gN, gD = output_grads(ac, go, ahat @ S, z[..., None, :])
            dahat = gN @ mT(S)
            P = P + gsum(mT(ahat) @ gN)
            da = rot(dahat, s0, s1, transpose=True)
            if gD is not None:
                da = da + gD[..., None] * z[..., None, :]
                Q = Q + gsum(xp.sum(gD[..., None] * ac, axis=-2))
            dq_parts.append(da if slope is None else da * slope)
        for s0, s1 in bounds:                                                        # keys and values
            bc, slope, bhat = features(kg, s0, s1)
            vc = vg[..., s0:s1, :]
            db = rot(vc @ mT(P), s0, s1, transpose=True) + Q[..., None, :]
            dk_parts.append(db if slope is None else db * slope)
            dv_parts.append(bhat @ P)
        dS0, dz0 = P, Q
    else:
        n_max = max(1, step)
        pw64 = None if decay is None else decay_powers(decay, n_max)               # (B, Hk, n_max + 1)
        weights = {}
        tril = xp.arange(n_max, device=dev)[:, None] >= xp.arange(n_max, device=dev)[None, :]

        def chunk_weights(n):
            if pw64 is None:
                return None
            if n not in weights:
                weights[n] = _chunk_weights(xp, pw64, n, host, dev)
            return weights[n]

        def scaled(x, w):
            return x if w is None else x * w

        starts = []
        for s0, s1 in bounds:                                                        # states before each chunk
            starts.append((S, z))
            n = s1 - s0
            bc, _, bhat = features(kg, s0, s1)
            vc = vg[..., s0:s1, :]
            cw = chunk_weights(n)
            if cw is None:
                S = S + mT(bhat) @ vc
                z = z + xp.sum(bc, axis=-2)
            else:
                _, _, tail, keep = cw
                S = S * keep + mT(bhat * tail) @ vc
                z = z * keep[..., 0] + xp.sum(bc * tail, axis=-2)
        zero = xp.zeros((), dtype=work, device=dev)
        for (s0, s1), (S_in, z_in) in zip(reversed(bounds), reversed(starts)):
            n = s1 - s0
            mask = tril[:n, :n]
            cw = chunk_weights(n)
            gam, inter, tail, keep = (None,) * 4 if cw is None else cw
            ac, qslope, ahat = features(qg, s0, s1)
            bc, kslope, bhat = features(kg, s0, s1)
            vc, go = vg[..., s0:s1, :], gog[..., s0:s1, :]
            scores = xp.where(mask, scaled(ahat @ mT(bhat), gam), zero)               # (B, Hk, G, n, n)
            num = scaled(ahat @ S_in, inter) + scores @ vc
            if normalize:
                dmask = xp.astype(mask, work) if gam is None else gam                # gamma^(i-j), j <= i
                z_rows = scaled(z_in[..., None, :], inter) + dmask @ bc             # (B, Hk, 1, n, m)
            gN, gD = output_grads(ac, go, num, z_rows if normalize else None)
            W = xp.where(mask, scaled(gN @ mT(vc), gam), zero)                        # gamma^(i-j) gN_i . v_j
            dahat = scaled(gN @ mT(S_in), inter) + W @ bhat
            dbhat = gsum(mT(W) @ ahat) + scaled(vc @ mT(P), tail)
            dvc = gsum(mT(scores) @ gN) + scaled(bhat @ P, tail)
            da = rot(dahat, s0, s1, transpose=True)
            db = rot(dbhat, s0, s1, transpose=True)
            P_next = scaled(P, keep) + gsum(mT(ahat) @ scaled(gN, inter))
            if gD is not None:
                ga = gD[..., None] * ac                                              # (B, Hk, G, n, m)
                da = da + gD[..., None] * z_rows
                db = db + gsum(mT(dmask) @ ga) + scaled(Q[..., None, :], tail)
                Q = (Q if keep is None else Q * keep[..., 0]) + gsum(xp.sum(scaled(ga, inter), axis=-2))
            else:
                db = db + scaled(Q[..., None, :], tail)
                Q = Q if keep is None else Q * keep[..., 0]
            P = P_next
            dq_parts.append(da if qslope is None else da * qslope)
            dk_parts.append(db if kslope is None else db * kslope)
            dv_parts.append(dvc)
        dq_parts.reverse()
        dk_parts.reverse()
        dv_parts.reverse()
        dS0, dz0 = P, Q                            # dL/d of the state before the first chunk: the carried one

    def joined(parts, groups, c, dtype):
        if not parts:
            return xp.zeros((B, T, Hk * groups, c), dtype=dtype, device=dev)
        return ungrouped(parts[0] if len(parts) == 1 else xp.concat(parts, axis=-2), dtype)

    dq = joined(dq_parts, G, m, q.dtype)
    dk = joined(dk_parts, 1, m, k.dtype)
    dvv = joined(dv_parts, 1, dv, v.dtype)
    dstate = None
    if state is not None:
        dstate = (xp.reshape(dS0, (B, Hk, m, dv)), xp.reshape(dz0, (B, Hk, m)))
    return dq, dk, dvv, dstate

"""Reference linear attention with RoPE in the numerator (RoFormer eq. 19); any array-API namespace.

With a = phi(q), b = phi(k), â = R_p a, b̂ = R_p b (rotation per layout/rotary_dim)::

    o_t = (â_t · (S0 + sum_s b̂_s v_s^T)) / (a_t · (z0 + sum_s b_s) + eps)

s over all tokens (non-causal) or s <= t (causal). Non-causal: one reduction (S, z) then one
readout, O(T m dv). Causal: chunks of C rows; per chunk the intra-chunk masked quadratic
``tril(Â_c B̂_c^T) V_c`` plus the carried state ``Â_c S``, the denominator from a row cumsum of
B_c plus the carried z; then ``S += B̂_c^T V_c``, ``z += sum B_c``. Features and rotations are made
chunk by chunk too, so temporaries are chunk-sized: never a T x T matrix, never a T x m x dv tensor.
Sums are blocked per chunk in the work dtype (float32, float64 for float64 input). All array
operations of that generic path are functional (no in-place writes), so JAX arrays work too.

NumPy arrays take ``_linear_attention_numpy`` instead: the same chunk algebra for a group of G chunks
of all (B, H) at once (batched matmuls on contiguous (B*H*G, C, .) stacks, no Python loop over chunks
or heads), with the chunk states as an exclusive prefix sum over the group's chunk increments in the
work dtype on top of the carried state. The carry is float64 between groups when a call spans several
groups and T >= min(m, dv); otherwise (one group, or decode-sized calls on a wide state) it stays in
the work dtype, which is still no more roundings than the generic path's per-chunk running sum. Group
sizes keep the temporaries cache-sized (``_GROUP_ELEMENTS``, ``_STATE_ELEMENTS``) and their buffers are
reused across groups. Rotation: ``x * cos_full + swap(x) * sin_signed``, the same products as
``_rotate_xp``. The returned state has the work dtype, as before.

A packed batch (``cu_seqlens``) runs as padded batches of its sequences through the same two paths
(``_packed_sequences``).
"""

from __future__ import annotations

from array_api_compat import array_namespace, device as xp_device, is_numpy_array

from .padded_batch import gather_padded, merge_sequences, merge_tokens, plan_buckets
from .array_api import _compute_dtype, _rotate_xp, gather_rows, visible_matmul
from .feature_maps import NAMES, check_name, feature_map as feature_map_np, feature_map_xp

FEATURE_MAPS = NAMES


def _feature_map(xp, x, name):
    """phi(x), the bits of :mod:`.feature_maps` (elu(x) + 1, relu(x) or x; NaN kept, relu(-0) = +0)."""
    check_name(name)
    if is_numpy_array(x):
        return feature_map_np(x, name)
    return feature_map_xp(xp, x, name)


def _heads_first(xp, x):
    """(B, n, H, D) -> (B, H, n, D); a contiguous copy for NumPy so that the matmuls hit BLAS."""
    y = xp.permute_dims(x, (0, 2, 1, 3))
    if is_numpy_array(y):
        import numpy as np

        y = np.ascontiguousarray(y)
    return y


def decay_powers(decay, n):
    """gamma^j for j = 0..n, float64 (B, Hk, n + 1), of a float64 (B, Hk) decay (None: all ones)."""
    import numpy as np

    if decay is None:
        return None
    return np.power(np.asarray(decay, np.float64)[..., None], np.arange(n + 1, dtype=np.float64))


def _expand_heads(xp, x, groups, axis):
    """x with every index along ``axis`` repeated ``groups`` times (k/v head j -> q heads jG .. jG+G-1)."""
    if groups == 1 or x is None:
        return x
    idx = xp.arange(x.shape[axis] * groups, device=xp_device(x)) // groups
    return xp.take(x, idx, axis=axis)


def linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                     decay=None, normalize=True, cu_seqlens=None):
    """(o, (S, z)) for canonical q (B, S, H, m), k (B, S, Hk, m), v (B, S, Hk, dv); see the module docstring.

    GQA (H = G Hk) runs on k, v, state and decay repeated to q's heads (the reference keeps it simple:
    G times the state work); the state returned is per k/v head (every G-th q head's).

    ``cu_seqlens`` (N + 1 offsets; q, k, v of batch 1, rows (1, T)): a packed batch, sequence n its
    tokens cu_seqlens[n] .. cu_seqlens[n + 1] - 1 with state and decay row n; states (N, Hk, ...).
    It runs as padded batches of sequences, not sequence by sequence (``_packed_sequences``).
    """
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}")
    kw = dict(rotary_dim=rotary_dim, layout=layout, causal=causal, feature_map=feature_map, eps=eps, chunk=chunk,
              normalize=normalize)
    if cu_seqlens is not None:
        return _packed_sequences(q, k, v, cos, sin, rows, cu_seqlens, state, decay, kw)
    return _batched(q, k, v, cos, sin, rows, state=state, decay=decay, **kw)


def _batched(q, k, v, cos, sin, rows, *, state, decay, lengths=None, **kw):
    """linear_attention on a (B, S, ...) batch: GQA heads expanded, then the NumPy path or the generic one.
    ``lengths`` (B,): row b's tokens past lengths[b] are padding (see ``_linear_attention_xp``)."""
    xp = array_namespace(q, k, v)
    groups = q.shape[2] // k.shape[2] if k.shape[2] else 1
    k, v = _expand_heads(xp, k, groups, 2), _expand_heads(xp, v, groups, 2)
    if state is not None:
        S0, z0 = state
        if z0 is None:
            z0 = xp.zeros(tuple(S0.shape[:-1]), dtype=S0.dtype, device=xp_device(S0))
        state = (_expand_heads(xp, S0, groups, 1), _expand_heads(xp, z0, groups, 1))
    if decay is not None:
        import numpy as np

        decay = np.repeat(np.asarray(decay, np.float64), groups, axis=1)
        if np.all(decay == 1):
            decay = None
    if decay is None and all(is_numpy_array(a) for a in (q, k, v, cos, sin)) and (
            state is None or all(is_numpy_array(s) for s in state)):
        o, (S, z) = _linear_attention_numpy(q, k, v, cos, sin, rows, state=state, **kw)
    else:
        o, (S, z) = _linear_attention_xp(q, k, v, cos, sin, rows, state=state, decay=decay, lengths=lengths, **kw)
    if groups > 1:
        S, z = S[:, ::groups, ...], z[:, ::groups, ...]
    return o, (S, z)


#: an input that each feature map takes to 0 (phi(-inf) = exp(-inf) + max(-inf, 0) = 0 for elu + 1)
_ZERO_FEATURE_INPUT = {"elu": -float("inf"), "relu": 0.0, "identity": 0.0}


def _packed_sequences(q, k, v, cos, sin, rows, cu_seqlens, state, decay, kw):
    """A packed batch as padded (nb, W, ...) batches (``padded_batch``), the per-sequence states and decay
    rows as their batch, one ``_batched`` call each; outputs back in packed order, states stacked (N, ...).

    torch, JAX, array-api-strict arrays: one padded batch of all sequences. NumPy arrays: the sequences
    sorted by length in cache-sized blocks (rows' states within ``_STATE_ELEMENTS``, chunk temporaries
    within ``_GROUP_ELEMENTS``, as the token groups of ``_linear_attention_numpy``), each padded to its own
    longest; a small batch is one block. Either way a sequence that would take a batch past
    ``_padded_batch.PAD_RATIO`` x its real tokens in padding starts a batch of its own.

    A padded slot adds nothing: its key is an input the feature map takes to exactly 0
    (``_ZERO_FEATURE_INPUT``; phi(0) is 1 for elu), its value 0, so it adds nothing to S, z or another
    token's output; with decay the state is read at each sequence's last real token (``lengths``), not
    decayed through the padding. Padded queries are 0, their outputs dropped. An empty sequence is in no
    batch and keeps its state (zeros without one).
    """
    import numpy as np

    xp = array_namespace(q, k, v)
    dev = xp_device(q)
    work = _compute_dtype(q.dtype, xp)
    _, T, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    if is_numpy_array(q):   # cache-sized blocks of sequences, as the token groups of _linear_attention_numpy
        plan = plan_buckets(cu_seqlens, max_rows=max(1, _STATE_ELEMENTS // max(1, H * m * dv)),
                            max_elements=_GROUP_ELEMENTS, token_cost=H * max(m, dv), chunk=int(kw["chunk"]))
    else:
        plan = plan_buckets(cu_seqlens)
    packed = [(x[0, ...], 0) for x in (q, v)] + [(k[0, ...], _ZERO_FEATURE_INPUT[kw["feature_map"]]),
                                                  (xp.reshape(rows, (-1,)), 0)]
    outs, S_parts, z_parts = [], [], []
    for bucket in plan.buckets:
        nb, width = bucket.ids.size, bucket.width
        qb, vb, kb, rb = (xp.reshape(gather_padded(xp, x, bucket.gather, fill), (nb, width) + tuple(x.shape[1:]))
                          for x, fill in packed)
        st = None
        if state is not None:
            ids = xp.asarray(bucket.ids, device=xp_device(state[0]))
            st = tuple(None if s is None else xp.take(s, ids, axis=0) for s in state)
        o, (S, z) = _batched(qb, kb, vb, cos, sin, rb, state=st,
                             decay=None if decay is None else np.asarray(decay)[bucket.ids],
                             lengths=bucket.lengths, **kw)
        outs.append(xp.reshape(o, (nb * width, H, dv)))
        S_parts.append(S)
        z_parts.append(z)
    if plan.empty.size:                                   # empty sequences keep their state (or zeros)
        ne = int(plan.empty.size)
        if state is None:
            S_parts.append(xp.zeros((ne, Hk, m, dv), dtype=work, device=dev))
            z_parts.append(xp.zeros((ne, Hk, m), dtype=work, device=dev))
        else:
            ids = xp.asarray(plan.empty, device=xp_device(state[0]))
            S_parts.append(xp.astype(xp.take(state[0], ids, axis=0), work))
            z_parts.append(xp.zeros((ne, Hk, m), dtype=work, device=dev) if state[1] is None else
                           xp.astype(xp.take(state[1], ids, axis=0), work))
    if not outs:
        o = xp.zeros((1, T, H, dv), dtype=q.dtype, device=dev)
    else:
        o = xp.reshape(merge_tokens(xp, plan, outs), (1, T, H, dv))
    if not S_parts:
        return o, (xp.zeros((0, Hk, m, dv), dtype=work, device=dev), xp.zeros((0, Hk, m), dtype=work, device=dev))
    return o, (merge_sequences(xp, plan, S_parts), merge_sequences(xp, plan, z_parts))


def _linear_attention_xp(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                         normalize=True, decay=None, lengths=None):
    """The generic array-API path (torch, JAX, array-api-strict, NumPy with decay): a Python loop over chunks.

    With decay (causal only; (B, H) float64 gammas), relative powers within a chunk of n rows::

        N_i = gamma^(i+1) Â_i S + sum_{j<=i} gamma^(i-j) (Â_i . B̂_j) V_j
        z_i = gamma^(i+1) z + sum_{j<=i} gamma^(i-j) B_j
        S <- gamma^n S + sum_j gamma^(n-1-j) B̂_j V_j^T,   z <- z_(n-1)

    Every power has an exponent in 0..n (no gamma^-t), so it is exact for gamma near 0 and near 1.
    ``lengths`` (B,), for a padded batch whose padded tokens have zero features and values: the state is
    the one after row b's first lengths[b] tokens. Padding adds nothing, but with decay it would still
    decay the state, so there n becomes each row's real tokens in the chunk, n_b (0 past its end)::

        S <- gamma^n_b S + sum_{j<n_b} gamma^(n_b-1-j) B̂_j V_j^T,   z <- gamma^n_b z + sum_{j<n_b} gamma^(n_b-1-j) B_j
    """
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

    def finish(num, den):
        return num / (den + eps) if normalize else num

    if state is None:
        S = xp.zeros((B, H, m, dv), dtype=work, device=dev)
        z = xp.zeros((B, H, m), dtype=work, device=dev)
    else:
        S, z = (xp.astype(s, work, copy=False) for s in state)
    step = max(1, min(int(chunk), q.shape[1]))   # never a chunk x chunk mask past T
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
            pieces.append(finish(xp.matmul(ahat, S), den))
    else:
        n_max = max(1, min(step, T))
        idx = xp.arange(n_max, device=dev)
        tril = idx[:, None] >= idx[None, :]
        zero = xp.zeros((), dtype=work, device=dev)
        if decay is not None:
            import numpy as np

            pw64 = decay_powers(decay, n_max)                                         # (B, H, n_max + 1)
            i = np.arange(n_max)
            mask64 = np.where(i[:, None] >= i[None, :], pw64[..., np.abs(i[:, None] - i[None, :])], 0.0)
            host = np.float64 if work == xp.float64 else np.float32
            pw = xp.asarray(pw64.astype(host), device=dev)
            rev = xp.asarray(np.ascontiguousarray(pw64[..., ::-1]).astype(host), device=dev)   # gamma^(n_max-j)
            dmask = xp.asarray(mask64.astype(host), device=dev)
        for s0, s1 in bounds:
            n = s1 - s0
            (ac, ahat), (bc, bhat), vc = features(q, s0, s1), features(k, s0, s1), values(s0, s1)
            scores = xp.where(tril[:n, :n], xp.matmul(ahat, xp.matrix_transpose(bhat)), zero)
            causal_mask = tril[:n, :n]   # a later token's NaN/inf must not reach earlier rows (0 * NaN)
            if decay is None:
                num = xp.matmul(ahat, S) + visible_matmul(xp, scores, vc, causal_mask)
                z_rows = z[:, :, None, :] + xp.cumulative_sum(bc, axis=-2)            # z after each row
                S = S + xp.matmul(xp.matrix_transpose(bhat), vc)
                z_next = z_rows[:, :, -1, :]
            else:
                d = dmask[:, :, :n, :n]                                              # gamma^(i-j), j <= i
                inter = pw[:, :, 1:n + 1, None]                                      # gamma^(i+1)
                num = xp.matmul(ahat, S) * inter + visible_matmul(xp, scores * d, vc, causal_mask)
                z_rows = z[:, :, None, :] * inter + visible_matmul(xp, d, bc, causal_mask)
                if lengths is None:
                    tail = rev[:, :, n_max - n + 1:n_max + 1, None]                  # gamma^(n-1-j)
                    keep = pw[:, :, n:n + 1]                                         # gamma^n
                    z_next = z_rows[:, :, -1, :]
                else:                                                                # padded rows: n_b real
                    tail, keep = (xp.asarray(w.astype(host), device=dev)
                                  for w in _real_token_weights(pw64, np.asarray(lengths) - s0, n))
                    z_next = z * keep + xp.sum(bc * tail, axis=-2)
                S = S * keep[..., None] + xp.matmul(xp.matrix_transpose(bhat * tail), vc)
            den = xp.sum(ac * z_rows, axis=-1, keepdims=True)
            pieces.append(finish(num, den))
            z = z_next
    o = xp.concat(pieces, axis=-2) if pieces else xp.zeros((B, H, 0, dv), dtype=work, device=dev)
    o = xp.astype(xp.permute_dims(o, (0, 2, 1, 3)), q.dtype)                        # (B, T, H, dv)
    return o, (S, z)


def _real_token_weights(pw64, remaining, n):
    """float64 (B, H, n, 1) gamma^(n_b-1-j) for j < n_b, else 0, and (B, H, 1) gamma^n_b, with n_b the
    real tokens of row b in a chunk of n rows (``remaining`` (B,) clipped to 0..n); pw64 (B, H, >n) gamma^j."""
    import numpy as np

    n_b = np.clip(remaining, 0, n)
    expo = n_b[:, None] - 1 - np.arange(n)                                          # (B, n)
    tail = np.where(expo[:, None, :] >= 0, np.take_along_axis(pw64, np.maximum(expo, 0)[:, None, :], axis=-1), 0.0)
    keep = np.take_along_axis(pw64, n_b[:, None, None], axis=-1)
    return tail[..., None], keep


# -- NumPy: chunkwise-parallel form ------------------------------------------------------------------
# A group of G chunks of all (B, H) at once: features and rotations in preallocated buffers, then batched
# matmuls over (B*H*G) stacks: intra-chunk scores tril(Â_c B̂_cᵀ), their product with V_c, the chunk
# increments B̂_cᵀ V_c; an exclusive prefix sum of the increments over the group's chunks (work dtype) on top
# of the carried state, which is float64 between groups; then Â_c S_[c]. The denominator: a row cumsum of B_c
# per chunk plus the exclusive prefix of chunk sums plus the carried z (float64 between groups).
_GROUP_ELEMENTS = 1 << 18         # cap on a group's B*H*L*max(m, dv): a few such buffers stay in L2
_STATE_ELEMENTS = 1 << 18         # cap on a group's B*H*G*m*dv (the materialised chunk states)


def _group_chunks(bh, step, m, dv, nchunks):
    g = min(_GROUP_ELEMENTS // max(1, bh * step * max(m, dv)), _STATE_ELEMENTS // max(1, bh * m * dv))
    return max(1, min(nchunks, g))


def _full_width_tables(cos_tok, sin_tok, rotary_dim, layout):
    """(Bp, 1, T, rotary_dim) tables cf, sf with ``R_p x = x * cf + swap(x) * sf`` on the rotated dims."""
    import numpy as np

    if layout == "half":
        cf = np.concatenate([cos_tok, cos_tok], axis=-1)
        sf = np.concatenate([-sin_tok, sin_tok], axis=-1)
    else:
        cf = np.repeat(cos_tok, 2, axis=-1)
        sf = np.stack([-sin_tok, sin_tok], axis=-1).reshape(cf.shape)
    return cf, sf


def _features_np(x, s0, s1, cf, sf, rotary_dim, layout, feature_map, work, buf, tag):
    """(phi(x), R_p phi(x)) of tokens s0:s1, heads first, contiguous (B, H, n, m) in ``work``.

    Same products as ``_rotate_xp`` (``x_a c - x_b s`` = ``x_a c + x_b (-s)`` exactly), but full-width:
    one pair-swapped copy, then contiguous multiplies that broadcast the tables over the heads.
    """
    import numpy as np

    B, _, H, m = x.shape
    n = s1 - s0
    f = buf(tag + "f", (B, H, n, m), work)
    np.copyto(f, x[:, s0:s1].transpose(0, 2, 1, 3), casting="unsafe")
    sw = buf("swap", (B, H, n, m), work)
    if feature_map != "identity":
        feature_map_np(f, feature_map, out=f)
    rd, half = rotary_dim, rotary_dim // 2
    if rd < m:
        sw, r = sw[..., :rd], buf(tag + "r", (B, H, n, m), work)
        r[..., rd:] = f[..., rd:]
        rot, fr = r[..., :rd], f[..., :rd]
    else:
        r = rot = buf(tag + "r", (B, H, n, m), work)
        fr = f
    if layout == "half":       # the swapped halves as a view: (..., 2, half) read backwards on the 2-axis
        swapped = fr.reshape(*fr.shape[:-1], 2, half)[..., ::-1, :]
        np.multiply(swapped, sf[:, :, s0:s1].reshape(*sf.shape[:2], n, 2, half), out=sw.reshape(swapped.shape))
    else:
        sw[..., 0::2] = fr[..., 1::2]
        sw[..., 1::2] = fr[..., 0::2]
        sw *= sf[:, :, s0:s1]
    np.multiply(fr, cf[:, :, s0:s1], out=rot)
    rot += sw
    return f, r


def _row_cumsum(x, y):
    """Inclusive cumsum over axis 2 of (P, G, n, m) in x's dtype, as a blocked scan: ~2 sqrt(n) NumPy calls.

    Each row is a left-to-right sum of the rows up to it in the chunk (within a block of w rows, then plus
    the previous block's last row), so every sum has at most n terms, all in x's dtype. Written into y.
    """
    import numpy as np

    P, G, n, m = x.shape
    w = max(1, int(round(n ** 0.5)))
    nb = n // w
    head = nb * w
    blocks = y[:, :, :head].reshape(P, G, nb, w, m)
    src = x[:, :, :head].reshape(P, G, nb, w, m)
    blocks[:, :, :, 0] = src[:, :, :, 0]
    for i in range(1, w):
        np.add(blocks[:, :, :, i - 1], src[:, :, :, i], out=blocks[:, :, :, i])
    for j in range(1, nb):
        blocks[:, :, j] += blocks[:, :, j - 1, -1:]
    for i in range(head, n):
        np.add(y[:, :, i - 1], x[:, :, i], out=y[:, :, i])
    return y


def _outer_sum(kt, v3, out):
    """kt @ v3 for (P, m, n) @ (P, n, dv); one token (decode) as a broadcast product (BLAS is slow at K = 1)."""
    import numpy as np

    if kt.shape[-1] == 1:
        return np.multiply(kt, v3, out=out)
    return np.matmul(kt, v3, out=out)


def _accumulate(a, inc, owned, i):
    """a + inc: in place once ``a`` is this call's own array (owned[i]), else a new array."""
    if owned[i]:
        a += inc
        return a
    owned[i] = True
    return a + inc


def _linear_attention_numpy(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                           normalize=True):
    import numpy as np

    work = np.float64 if q.dtype == np.float64 else np.float32
    B, T, H, m = q.shape
    dv = v.shape[-1]
    bh = B * H
    flat = np.asarray(rows).reshape(-1)
    bp = rows.shape[0]
    cos_tok = np.take(cos, flat, axis=0).astype(work, copy=False).reshape(bp, 1, T, -1)
    sin_tok = np.take(sin, flat, axis=0).astype(work, copy=False).reshape(bp, 1, T, -1)
    step = max(1, min(int(chunk), q.shape[1]))   # never a chunk x chunk mask past T
    G = _group_chunks(bh, step, m, dv, max(1, T // step))
    # The carried (S, z) is float64 between groups; a call with a single group, or one shorter than the
    # state is wide (decode), carries in the work dtype: a couple of roundings at most, and no float64
    # copies of a state much larger than the call's tokens.
    carry = np.float64 if T > G * step and T >= min(m, dv) else work
    if state is None:
        S = np.zeros((bh, m, dv), dtype=carry)
        z = np.zeros((bh, m), dtype=carry)
    else:   # the state passed in is never written: the first update below is out of place (_accumulate)
        S = np.reshape(state[0], (bh, m, dv)).astype(carry, copy=False)
        z = np.reshape(state[1], (bh, m)).astype(carry, copy=False)
    owned = [state is None, state is None]                  # S, z are this call's own arrays
    o = np.empty((B, T, H, dv), dtype=q.dtype)
    pool = {}

    def buf(name, shape, dtype=work, zeros=False):
        """A work buffer reused by every group of the same shape (fresh large arrays cost page faults)."""
        key = (name, shape, dtype)
        a = pool.get(key)
        if a is None:
            a = pool[key] = np.zeros(shape, dtype=dtype) if zeros else np.empty(shape, dtype=dtype)
        return a

    cf, sf = _full_width_tables(cos_tok, sin_tok, rotary_dim, layout)

    def feats(x, s0, s1, tag):
        return _features_np(x, s0, s1, cf, sf, rotary_dim, layout, feature_map, work, buf, tag)

    def values(s0, s1, n):
        """V of tokens s0:s1 in chunks of n rows, contiguous (B*H*g, n, dv)."""
        val = buf("v", (B, H, s1 - s0, dv))
        np.copyto(val, v[:, s0:s1].transpose(0, 2, 1, 3), casting="unsafe")
        return val.reshape(-1, n, dv)

    def keys_t(bhat, n):
        """B̂ per chunk of n rows, transposed and contiguous (B*H*g, m, n): BLAS takes it without a copy."""
        b3 = bhat.reshape(-1, n, m)
        bt = buf("kt", (b3.shape[0], m, n))
        np.copyto(bt, b3.transpose(0, 2, 1))
        return bt

    def store(s0, s1, num, den):
        """o[:, s0:s1] = num / (den + eps) (num alone without normalize); num (B*H*..., dv) rows of tokens
        s0:s1, den the same rows."""
        if normalize:
            den += eps
            num /= den[..., None]
        o[:, s0:s1] = num.reshape(B, H, s1 - s0, dv).transpose(0, 2, 1, 3)

    if not causal:
        for s0 in range(0, T, G * step):
            s1 = min(T, s0 + G * step)
            g, n = divmod(s1 - s0, step)
            for t0, t1, gg, nn in ((s0, s0 + g * step, g, step), (s0 + g * step, s1, 1, n)):
                if t1 <= t0:
                    continue
                bc, bhat = feats(k, t0, t1, "k")
                dS = _outer_sum(keys_t(bhat, nn), values(t0, t1, nn), buf("dS", (bh * gg, m, dv)))   # B̂_cᵀ V_c
                S = _accumulate(S, dS.reshape(bh, gg, m, dv).sum(axis=1), owned, 0)   # <= G chunk sums, then the carry
                z = _accumulate(z, bc.reshape(bh, gg, nn, m).sum(axis=2).sum(axis=1), owned, 1)
        Sw, zw = S.astype(work, copy=False), z.astype(work, copy=False)
        L = max(1, _GROUP_ELEMENTS // max(1, bh * max(m, dv)))
        for s0 in range(0, T, L):
            s1 = min(T, s0 + L)
            ac, ahat = feats(q, s0, s1, "q")
            num = np.matmul(ahat.reshape(bh, s1 - s0, m), Sw, out=buf("num", (bh, s1 - s0, dv)))
            den = np.matmul(ac.reshape(bh, s1 - s0, m), zw[:, :, None])[..., 0]
            store(s0, s1, num, den)
    else:
        nfull, tail = divmod(T, step)
        groups = [(s0, min(nfull * step, s0 + G * step), step) for s0 in range(0, nfull * step, G * step)]
        if tail:
            groups.append((nfull * step, T, tail))
        idx = np.arange(step)
        upper = idx[:, None] < idx[None, :]                                         # strictly above the diagonal
        for s0, s1, n in groups:
            g = (s1 - s0) // n
            (ac, ahat), (bc, bhat), v3 = feats(q, s0, s1, "q"), feats(k, s0, s1, "k"), values(s0, s1, n)
            ahat3 = ahat.reshape(bh * g, n, m)
            bhat3 = bhat.reshape(bh * g, n, m)
            scores = np.matmul(ahat3, bhat3.transpose(0, 2, 1), out=buf("scores", (bh * g, n, n)))
            np.copyto(scores, 0, where=upper[:n, :n])
            num = np.matmul(scores, v3, out=buf("num", (bh * g, n, dv)))               # intra-chunk
            if not np.isfinite(num).all():   # a later token's NaN/inf must not reach earlier rows (0 * NaN)
                np.copyto(num, visible_matmul(np, scores, v3, ~upper[:n, :n], product=num))
            dS = _outer_sum(keys_t(bhat, n), v3, buf("dS", (bh * g, m, dv))).reshape(bh, g, m, dv)   # increments
            if g == 1 and carry == work:                          # the state itself is S before the chunk
                num += np.matmul(ahat3, S, out=buf("inter", num.shape))
                S = _accumulate(S, dS[:, 0], owned, 0)
            else:
                # S before chunk j: the carried state (rounded to work) + a work-dtype sum of <= G increments
                prefix = buf("prefix", dS.shape)
                carried = prefix[:, 0]
                np.copyto(carried, S, casting="unsafe")
                run = buf("run", S.shape)
                np.copyto(run, dS[:, 0])
                for j in range(1, g):
                    np.add(run, carried, out=prefix[:, j])
                    if j < g - 1:
                        run += dS[:, j]
                if g > 1:
                    run += dS[:, g - 1]
                S = _accumulate(S, run, owned, 0)
                num += np.matmul(ahat3, prefix.reshape(bh * g, m, dv), out=buf("inter", num.shape))
            b4 = bc.reshape(bh, g, n, m)
            zrows = _row_cumsum(b4, buf("zrows", b4.shape))                          # within each chunk
            zchunk = np.empty((bh, g, m), dtype=work)                                # z before each chunk
            carried = z.astype(work)
            zchunk[:, 0] = carried
            zrun = zrows[:, 0, -1].copy()
            for j in range(1, g):
                np.add(zrun, carried, out=zchunk[:, j])
                zrun += zrows[:, j, -1]
            z = _accumulate(z, zrun, owned, 1)
            zrows += zchunk[:, :, None, :]
            den = np.einsum("...i,...i->...", ac.reshape(bh, g, n, m), zrows, out=buf("den", (bh, g, n)))
            store(s0, s1, num, den.reshape(bh * g, n))
    S = S.astype(work, copy=not owned[0])
    z = z.astype(work, copy=not owned[1])
    return o, (S.reshape(B, H, m, dv), z.reshape(B, H, m))

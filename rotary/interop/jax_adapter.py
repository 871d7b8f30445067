"""JAX adapter: rotation and linear attention as JAX operations, correct under jit, grad and vmap.

JAX arrays (tracers included) run the reference array-API expression (``rotary.backends.numpy``) with
JAX operations, so XLA compiles it and JAX differentiates and batches it. Nothing of a trace is ever
cached: the cos/sin cache keeps host NumPy tables only and the JAX copies are made per call.

Positions:

- concrete (None, an int, NumPy, a concrete JAX array, or static under jit): the host computes exact
  angles in float64 (two-product, double-double reduction) as for NumPy; the tables enter the trace
  as constants.
- traced (a jit argument): the angle of position p = p2 * 2**22 + p1 * 2**11 + p0 is put together from
  three host tables (exact angles at p0, p1 * 2**11 and p2 * 2**22; 2 x 3 x 2048 x rotary_dim/2 values)
  by the angle-addition formulas, in the work dtype: a few ulp of cos/sin (float32: ~4e-7) at every
  position with -2**32 <= p < 2**32, instead of the ``p * inv_freq`` rounding error (~|p * inv_freq| * 6e-8
  rad, 0.06 rad at p = 10**6) a float32 product would have. The cost: three gathers and two complex
  products per token and frequency. Positions outside that range give NaN. Specs whose
  frequencies depend on the largest position (dynamic NTK, longrope) need concrete positions.
- ``out=`` is refused (JAX arrays are immutable).

``attention`` and ``linear_attention`` take traced positions the same way (``positions``, ``q_positions``/
``k_positions``, the mask positions; for linear attention also a state whose ``next_position`` is traced,
the carry of a ``lax.scan``/``fori_loop`` decode loop: the state is a pytree). Softmax attention then masks
every key block in JAX (``k_pos <= q_pos`` and the window, no block skipped) instead of the host's
block-sparse schedule. What the host must read stays static, and a traced value there raises an error
naming the argument and ``static_argnums``/``static_argnames``: ``causal``, ``window``, ``softcap``,
``block_size``, ``rope``, packing (``cu_seqlens``, ``seqlen_offsets``), spec keywords, ``decay``, ``eps``,
``chunk``; positions of multi-axis, float-position and length-dependent specs. A traced ``scale`` goes into
q (``cap(s <R q, R k>) = cap(<R (s q), R k>)``).

``jax.grad`` of ``linear_attention`` with concrete positions (and state) and a named feature map runs the
backend's backward primitive on the host (a ``jax.custom_vjp`` whose backward is a ``jax.pure_callback``:
:func:`_linear_attention_host_vjp`) when :data:`HOST_BACKWARD` allows it (default: JAX's default backend is
the CPU); otherwise, and for traced positions, JAX differentiates the jax.numpy forward itself.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..spec.rope_spec import RopeSpec

_DIGIT = 11
_ROWS = 1 << _DIGIT


def _is_tracer(a) -> bool:
    import jax

    return isinstance(a, jax.core.Tracer)


def _check_out(outs, names):
    for out, name in zip(outs, names):
        if out is not None:
            arg = "out" if len(names) == 1 else f"out for {name}"
            raise TypeError(f"{arg}= is not supported for JAX arrays (immutable; under jit a traced array cannot be "
                            "written): drop out= and use the return value")


def _check_backend(backend, names):
    if backend not in ("auto", "numpy"):
        raise ValueError(f"backend={backend!r} does not take JAX arrays: {names[0]} runs as JAX operations "
                         "(the array-API reference path, jit/grad/vmap-safe); pass backend='auto' or 'numpy', or "
                         "convert with numpy.asarray(...) outside jit to use the Numba/CuPy kernels")


def _concrete_positions(positions):
    """positions as a host value when it is concrete, else None (a tracer)."""
    if positions is None or isinstance(positions, (int, np.integer, np.ndarray)):
        return positions
    if _is_tracer(positions):
        return None
    return positions   # a concrete JAX array (or anything the frontend reads with np.asarray)


def rotate(core, xs, outs, names, positions, **kwargs):
    """``rotary.frontend.rotate.rotate_arrays`` for JAX arrays."""
    _check_out(outs, names)
    _check_backend(kwargs.get("backend", "auto"), names)
    concrete = _concrete_positions(positions)
    if concrete is not None or positions is None:
        return core(list(xs), list(outs), names, positions, **dict(kwargs, backend="numpy"))
    return _rotate_traced(xs, names, positions, **kwargs)


@functools.lru_cache(maxsize=64)
def _digit_tables(spec: RopeSpec):
    """Host float64 (cos, sin) tables of shape (3, 2048, half): level 0 at positions 0..2047 (times the
    attention scaling), level 1 at j * 2**11, level 2 at t * 2**22 for t = -1024..1023 (row t + 1024)."""
    scale = spec.attention_scaling_at(None)
    base = np.arange(_ROWS, dtype=np.int64)
    levels = (base, base << _DIGIT, (base - _ROWS // 2) << (2 * _DIGIT))
    cos = np.stack([np.cos(spec.angles(p)) for p in levels])
    sin = np.stack([np.sin(spec.angles(p)) for p in levels])
    cos[0] *= scale
    sin[0] *= scale
    cos.setflags(write=False)
    sin.setflags(write=False)
    return cos, sin


def traced_cos_sin(spec: RopeSpec, p, work):
    """(cos, sin) of spec's angles at traced integer positions p (any shape) -> p.shape + (half,)."""
    import jax.numpy as jnp

    cos_h, sin_h = _digit_tables(spec)
    cos_t, sin_t = jnp.asarray(cos_h, dtype=work), jnp.asarray(sin_h, dtype=work)
    p = jnp.asarray(p)
    mask = _ROWS - 1
    d0 = p & mask
    d1 = (p >> _DIGIT) & mask
    top = p >> (2 * _DIGIT)
    ok = (top >= -(_ROWS // 2)) & (top < _ROWS // 2)
    d2 = jnp.clip(top + _ROWS // 2, 0, _ROWS - 1)
    c, s = cos_t[0][d0], sin_t[0][d0]
    for level, d in ((1, d1), (2, d2)):
        c1, s1 = cos_t[level][d], sin_t[level][d]
        c, s = c * c1 - s * s1, s * c1 + c * s1
    nan = jnp.asarray(jnp.nan, dtype=work)
    return jnp.where(ok[..., None], c, nan), jnp.where(ok[..., None], s, nan)


def _rotate_traced(xs, names, positions, *, spec=None, seq_axis=None, inverse=False, backend="auto",
                   spec_kwargs=None, out_pairs=None, **unknown):
    import jax.numpy as jnp

    from ..frontend import normalize as _api
    from ..frontend.plan import output_layout
    from ..backends.numpy import _rotate_xp

    if unknown:
        raise TypeError(f"traced positions do not support the arguments {sorted(unknown)} yet; pass concrete "
                        "positions (static under jit)")
    xp = _api.namespace(list(xs), list(names))
    for x, name in zip(xs, names):
        _api.check_float(x, name, xp)
    x0 = xs[0]
    ax = _api.normalize_seq_axis(seq_axis, x0.ndim, names[0])
    spec = _api.resolve_spec(spec, spec_kwargs or {}, int(x0.shape[-1]), names[0])
    out_layout = output_layout(out_pairs, spec)
    if getattr(spec, "n_axes", 1) != 1 or getattr(spec, "float_positions", False):
        raise ValueError("positions is traced, but the spec reads several (or float) coordinates per token: pass "
                         "concrete positions (e.g. static_argnums under jit)")
    if spec.depends_on_seq_len:
        raise ValueError(f"positions is traced, but spec's rope_type {spec.rope_type!r} computes its frequencies "
                         "from the largest position: pass concrete positions (e.g. static_argnums under jit)")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse must be a bool, got {type(inverse).__name__}")
    p = jnp.asarray(positions)
    if not jnp.issubdtype(p.dtype, jnp.integer):
        raise TypeError(f"positions must have an integer dtype, got {p.dtype}")
    shape0 = tuple(x0.shape)
    seq = shape0[ax]
    B = _api.canonical_shape(shape0, ax)[0]
    if p.ndim == 0:
        p = (p + jnp.arange(seq, dtype=p.dtype))[None, :]
    elif p.ndim == 1 and p.shape[0] == seq:
        p = p[None, :]
    elif p.ndim == 2 and ax > 0 and p.shape == (shape0[0], seq):
        p = jnp.repeat(p, B // shape0[0], axis=0)
    elif p.ndim == 2 and ax > 0 and p.shape == (1, seq):   # one row for every batch entry (HF's position_ids)
        pass
    else:
        raise ValueError(f"positions of shape {tuple(p.shape)} must be ({seq},) or (batch, seq) = "
                         f"({shape0[0] if ax > 0 else 'no batch axis'}, {seq})")
    results = []
    cache = {}
    for x, name in zip(xs, names):
        if x.ndim != x0.ndim or any(x.shape[i] != x0.shape[i] for i in (ax, x0.ndim - 1)):
            raise ValueError(f"{name} of shape {tuple(x.shape)} must match {names[0]} of shape {shape0} in the "
                             "sequence axis and head_dim")
        work = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
        if work not in cache:
            c, s = traced_cos_sin(spec, p, work)
            cache[work] = c[:, :, None, :], (-s if inverse else s)[:, :, None, :]
        y = _rotate_xp(xp, _api.to_canonical(x, ax, xp), *cache[work], spec.rotary_dim, spec.layout,
                       spec.rotary_offset, out_layout)
        results.append(_api.from_canonical(y, tuple(x.shape), ax, xp))
    return results


# -- attention and linear attention under jit ---------------------------------------------------------
_STATIC = "make it static (jax.jit(f, static_argnums=...) or static_argnames=...) or pass a concrete value"


def _must_be_static(name, what):
    return ValueError(f"{name} is traced under jit, but {what} reads its value on the host (it decides shapes, "
                      f"branches or the table of positions): {_STATIC}")


def _check_traced_spec(spec, name):
    """The traced-position path takes 1-D integer specs whose frequencies do not depend on the length."""
    if spec.multi_axis or spec.float_positions:
        raise ValueError(f"{name} is traced under jit, but the spec reads several (or float) coordinates per "
                         f"token: {_STATIC}")
    if spec.depends_on_seq_len:
        raise ValueError(f"{name} is traced under jit, but spec's rope_type {spec.rope_type!r} computes its "
                         f"frequencies from the largest position: {_STATIC}")


def _jax_positions(p, lead, seq, name):
    """``normalize_positions`` for JAX: an integer JAX array (Bp, seq), Bp in {1, lead[0]}; p traced or not."""
    import jax
    import jax.numpy as jnp

    from ..frontend.normalize import normalize_positions

    if not _is_tracer(p):
        host = normalize_positions(p, lead, seq, name)
        if not jax.config.jax_enable_x64 and host.size and (host.min() < -2**31 or host.max() >= 2**31):
            raise ValueError(f"{name} reaches {int(host.max())} / {int(host.min())}, outside int32, and JAX runs "
                             "without x64 (jax.config.update('jax_enable_x64', True), or static positions)")
        return jnp.asarray(host)
    p = jnp.asarray(p)
    if not jnp.issubdtype(p.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {p.dtype}")
    if p.ndim == 0:
        return (p + jnp.arange(seq, dtype=p.dtype))[None, :]
    if p.ndim == 1 and p.shape[0] == seq:
        return p[None, :]
    if p.ndim == 2 and lead and p.shape in ((lead[0], seq), (1, seq)):   # (1, seq): every batch entry
        return p
    raise ValueError(f"{name} of shape {tuple(p.shape)} must be ({seq},) or (batch, seq) = "
                     f"({lead[0] if lead else 'no batch axis'}, {seq})")


_POSITION_ARGS = ("positions", "q_positions", "k_positions", "q_mask_positions", "k_mask_positions")


def attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.attention`` for JAX arrays. Concrete positions: the frontend (host positions, exact tables,
    the block-sparse schedule). Traced positions (jit arguments): positions as JAX integers, q and k rotated
    by :func:`_rotate_traced` (exact-angle host tables gathered by position), and every key block masked
    in JAX (:func:`_masked_attention`: no block is skipped, nothing is read back to the host). A traced
    ``scale`` goes into q: ``cap(s <R q, R k>) = cap(1 <R (s q), R k>)``."""
    import jax.numpy as jnp

    _check_backend(kwargs.get("backend", "auto"), ("q",))
    for name, value in kwargs.items():
        if name not in _POSITION_ARGS and name != "scale" and _is_tracer(value):
            raise _must_be_static(name, "attention")
    scale = kwargs.get("scale")
    if _is_tracer(scale):
        work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        o = attention(core, q.astype(work) * scale.astype(work), k, v, positions, **dict(kwargs, scale=1.0))
        return o.astype(q.dtype)
    if not any(_is_tracer(positions if n == "positions" else kwargs.get(n)) for n in _POSITION_ARGS):
        return core(q, k, v, positions, **kwargs)
    return _attention_traced(q, k, v, positions, **kwargs)


def _attention_traced(q, k, v, positions=None, *, causal=False, scale=None, spec=None, seq_axis=None, backend="auto",
                      rope=True, q_positions=None, k_positions=None, window=None, softcap=None, cu_seqlens=None,
                      cu_seqlens_k=None, seqlen_offsets=None, q_mask_positions=None, k_mask_positions=None,
                      block_size=512, **spec_kwargs):
    """:func:`attention` with traced positions: the frontend's rules (``rotary.attn.softmax``), in JAX."""
    import jax.numpy as jnp

    from ..attn import softmax

    traced = [n for n, p in zip(_POSITION_ARGS, (positions, q_positions, k_positions, q_mask_positions,
                                                 k_mask_positions)) if _is_tracer(p)]
    for name, value in (("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k),
                        ("seqlen_offsets", seqlen_offsets)):
        if value is not None:
            raise ValueError(f"{traced[0]} is traced under jit, but {name} (a packed batch) places the tokens on "
                             f"the host: make {traced[0]} static (jax.jit(f, static_argnums=...) or "
                             "static_argnames=...), or pass per-token concrete positions")
    xp, ax, gaxis, spec, scale, window, softcap, block_size = softmax.checked_arguments(
        q, k, v, causal=causal, scale=scale, spec=spec, seq_axis=seq_axis, rope=rope, window=window, softcap=softcap,
        block_size=block_size, spec_kwargs=spec_kwargs)
    if rope:
        _check_traced_spec(spec, traced[0])
    q_len, k_len = int(q.shape[ax]), int(k.shape[ax])
    q_lead, k_lead = tuple(q.shape[:ax]), tuple(k.shape[:ax])
    explicit = q_positions is not None or k_positions is not None
    if explicit and (q_positions is None or k_positions is None):
        raise ValueError("pass both q_positions and k_positions (or neither)")
    if explicit and positions is not None:
        raise ValueError("pass positions or q_positions/k_positions, not both")
    if explicit:
        qpos = _jax_positions(q_positions, q_lead, q_len, "q_positions")
        kpos = _jax_positions(k_positions, k_lead, k_len, "k_positions")
    else:
        if causal and q_len > k_len:
            raise ValueError(f"q_len ({q_len}) > k_len ({k_len}) with causal=True: the end-aligned causal mask "
                             "would hide every key from the first queries; pass q_positions/k_positions")
        kpos = _jax_positions(positions, k_lead, k_len, "positions")
        if q_len <= k_len:
            qpos = kpos[:, k_len - q_len:]
        else:   # non-causal, more queries than keys: end-aligned, the first queries before position 0
            qpos = kpos[:, :1] + jnp.arange(k_len - q_len, k_len, dtype=kpos.dtype)[None, :]
    mq, mk = qpos, kpos
    if softmax.mask_positions_given(q_mask_positions, k_mask_positions, causal):
        mq = _jax_positions(q_mask_positions, q_lead, q_len, "q_mask_positions")
        mk = _jax_positions(k_mask_positions, k_lead, k_len, "k_mask_positions")
    if gaxis == 0 and max(qpos.shape[0], kpos.shape[0], mq.shape[0], mk.shape[0]) > 1:
        raise ValueError("per-batch positions need a batch axis 0 that q and k share; here q and k differ "
                         "in their head counts on axis 0")
    if rope:
        q = _rotate_traced([q], ["q"], qpos[0] if qpos.shape[0] == 1 else qpos, spec=spec, seq_axis=ax)[0]
        k = _rotate_traced([k], ["k"], kpos[0] if kpos.shape[0] == 1 else kpos, spec=spec, seq_axis=ax)[0]
    del xp
    return _masked_attention(q, k, v, ax, gaxis, (mq, mk) if causal else None, window, scale, softcap, block_size)


def _masked_attention(q, k, v, ax, gaxis, mask, window, scale, softcap, block_size):
    """Online softmax (``rotary.backends.online_softmax``'s formulas) of rotated q, k against v, in JAX with
    a traced mask: ``mask = (q_pos (Bp, Sq), k_pos (Bp, Sk))`` shows key s to query t when
    ``k_pos[s] <= q_pos[t]`` (and ``q_pos[t] - k_pos[s] < window``), None: every key. Key blocks of
    ``block_size`` run in one ``lax.scan`` (the last one padded with hidden keys), query blocks in a loop;
    the running max is held out of the gradient (the result does not depend on it)."""
    import jax
    import jax.numpy as jnp

    from ..backends.array_api import visible_matmul
    from ..backends.online_softmax import _SCORE_BLOCK_ELEMENTS

    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    fold = scale / softcap if softcap else scale
    qf, kf, vf = (jnp.moveaxis(a, ax, -2) for a in (q, k, v))
    if gaxis is not None:   # (.., Hk, g, ..) for q, (.., Hk, 1, ..) for k and v: GQA by broadcasting
        gpos = gaxis - (1 if gaxis > ax else 0)
        hk, g = k.shape[gaxis], q.shape[gaxis] // k.shape[gaxis]
        qf = qf.reshape(qf.shape[:gpos] + (hk, g) + qf.shape[gpos + 1:])
        kf, vf = (a.reshape(a.shape[:gpos] + (hk, 1) + a.shape[gpos + 1:]) for a in (kf, vf))
    qf, kf, vf = qf.astype(work) * fold, kf.astype(work), vf.astype(work)
    lead = jnp.broadcast_shapes(qf.shape[:-2], kf.shape[:-2])
    sq, sk, dv = qf.shape[-2], kf.shape[-2], vf.shape[-1]
    if sq == 0 or sk == 0 or math.prod(lead) == 0:
        o = jnp.zeros(lead + (sq, dv), dtype=work)
    else:
        bk = max(1, min(block_size, sk))
        nb = -(-sk // bk)
        pad = nb * bk - sk

        def blocks(a):   # (..., sk, c) -> (nb, ..., bk, c), padded with zeros
            a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, pad), (0, 0)])
            return jnp.moveaxis(a.reshape(a.shape[:-2] + (nb, bk, a.shape[-1])), -3, 0)

        kb, vb = blocks(kf), blocks(vf)
        valid = (jnp.arange(nb * bk) < sk).reshape(nb, bk)
        mq, mk = mask if mask is not None else (None, jnp.zeros((1, sk), jnp.int32))
        mkb = jnp.moveaxis(jnp.pad(mk, [(0, 0), (0, pad)]).reshape(mk.shape[0], nb, bk), 1, 0)   # (nb, Bp, bk)
        n_lead = len(lead)
        q_block = max(1, min(sq, (_SCORE_BLOCK_ELEMENTS * 32) // (max(1, math.prod(lead)) * bk)))
        neg_inf = jnp.asarray(-jnp.inf, dtype=work)
        parts = []
        for q0 in range(0, sq, q_block):
            q1 = min(sq, q0 + q_block)
            qb = qf[..., q0:q1, :]
            mqb = None if mq is None else mq[:, q0:q1, None]

            def step(carry, block, qb=qb, mqb=mqb):
                m, l, acc = carry
                kt, vt, kp, ok = block
                s = jnp.matmul(qb, jnp.swapaxes(kt, -1, -2))
                if softcap:
                    s = jnp.tanh(s) * softcap
                vis = ok[None, None, :]
                if mqb is not None:
                    vis = vis & (kp[:, None, :] <= mqb)
                    if window is not None:
                        vis = vis & (mqb - kp[:, None, :] < window)
                vis = vis.reshape((vis.shape[0],) + (1,) * (n_lead - 1) + vis.shape[1:]) if n_lead else vis[0]
                masked = mqb is not None or pad
                if masked:
                    s = jnp.where(vis, s, neg_inf)
                m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True)))
                m_safe = jnp.where(m_new == neg_inf, jnp.zeros((), work), m_new)
                p = jnp.exp(s - m_safe)
                alpha = jnp.exp(m - m_safe)
                pv = jnp.matmul(p, vt)
                if masked:   # a masked key's NaN/inf must not reach the product (0 * NaN)
                    pv = visible_matmul(jnp, p, vt, vis, product=pv)
                return (m_new, l * alpha + jnp.sum(p, axis=-1, keepdims=True), acc * alpha + pv), None

            shape = lead + (q1 - q0,)
            init = (jnp.full(shape + (1,), -jnp.inf, work), jnp.zeros(shape + (1,), work),
                    jnp.zeros(shape + (dv,), work))
            (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, mkb, valid))
            parts.append(acc / jnp.where(l > 0, l, jnp.ones((), work)))
        o = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)
    if gaxis is not None:
        o = o.reshape(o.shape[:gpos] + (q.shape[gaxis],) + o.shape[gpos + 2:])
    return jnp.moveaxis(o, -2, ax).astype(q.dtype)


def linear_attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.linear_attention`` for JAX arrays: the reference path as JAX operations (the returned state
    holds JAX arrays and is a JAX pytree: a ``lax.scan``/``fori_loop`` carry). Concrete positions (and a
    state whose next position is concrete): host tables as for NumPy. Traced positions, or a state whose
    next position is traced (a decode loop's carry): the cos/sin rows of :func:`traced_cos_sin` (exact-angle
    host tables gathered by position), one row per token, and a traced next position."""
    import inspect

    import jax.numpy as jnp

    from ..attn import linear
    from ..attn.linear_state import LinearAttentionState
    from ..frontend.normalize import normalize_seq_axis

    if kwargs.pop("save_for_backward", False):   # JAX's vjp keeps its own residuals: nothing saved here
        from ..attn.linear import nothing_saved

        return nothing_saved(linear_attention(core, q, k, v, positions, **kwargs), kwargs.get("return_state"))
    _check_backend(kwargs.get("backend", "auto"), ("q",))
    for name, value in kwargs.items():
        if name != "state" and _is_tracer(value):
            raise _must_be_static(name, "linear_attention")
    kwargs["backend"] = "numpy"
    state = kwargs.get("state")
    start = state.next_position if isinstance(state, LinearAttentionState) else None
    from_state = positions is None and start is not None and not isinstance(start, (int, np.ndarray))
    if from_state and not _is_tracer(start):   # a concrete JAX next position (a jitted call's state): host
        start = np.asarray(start).astype(np.int64)
        start = int(start) if start.ndim == 0 else start
        kwargs["state"] = LinearAttentionState._trusted(state.S, state.z, start, state.spec, state.feature_map,
                                                        state.decay, state.normalize, state.groups)
        from_state = False
    if not from_state and (positions is None or not _is_tracer(positions)):
        if _host_backward(kwargs):
            return _linear_attention_host_vjp(core, q, k, v, positions, kwargs)
        return core(q, k, v, positions, **kwargs)
    bound = inspect.signature(core).bind(q, k, v, positions, **kwargs)
    bound.apply_defaults()
    args = bound.arguments
    name = "state.next_position" if from_state else "positions"
    for other in ("cu_seqlens", "seqlen_offsets"):
        if args[other] is not None:
            raise ValueError(f"{name} is traced under jit, but {other} (a packed batch) places the tokens on the "
                             f"host: make {name} static (jax.jit(f, static_argnums=...) or static_argnames=...)")
    ax = normalize_seq_axis(args["seq_axis"], q.ndim, "q")
    lead, seq = tuple(q.shape[:ax]), int(q.shape[ax])
    if from_state:
        start = jnp.asarray(start)
        if start.ndim == 0:
            p = (start + jnp.arange(seq, dtype=start.dtype))[None, :]
        elif lead and start.shape == (lead[0],):
            p = start[:, None] + jnp.arange(seq, dtype=start.dtype)[None, :]
        else:
            raise ValueError(f"state.next_position of shape {tuple(start.shape)} does not match the batch axis "
                             f"(size {lead[0] if lead else 'none'}) of q")
    else:
        p = _jax_positions(positions, lead, seq, "positions")
    if seq:
        nxt = p[0, -1] + 1 if p.shape[0] == 1 else p[:, -1] + 1
    else:
        nxt = start if from_state else (jnp.asarray(positions) if jnp.ndim(positions) == 0 else jnp.zeros((), p.dtype))

    def angles(spec, B, dtype):
        _check_traced_spec(spec, name)
        work = jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32
        pb = p if p.shape[0] in (1, B) else jnp.repeat(p, B // p.shape[0], axis=0)
        c, s = traced_cos_sin(spec, pb, work)
        rows = jnp.arange(pb.size, dtype=jnp.int32).reshape(pb.shape)
        return c.reshape(-1, c.shape[-1]), s.reshape(-1, s.shape[-1]), rows, nxt

    spec_kwargs = args.pop("spec_kwargs")
    del args["q"], args["k"], args["v"], args["positions"]
    return linear.checked_call(q, k, v, None, **args, spec_kwargs=spec_kwargs, angles=angles)


# -- linear attention's backward: the backend primitive on the host -------------------------------------------
#: Whether JAX's gradient of ``rotary.linear_attention`` is the backend's backward primitive on the host
#: (:func:`_linear_attention_host_vjp`): None (default) when JAX's default backend is the CPU, True / False to
#: force it on or off. Off, JAX differentiates the forward's jax.numpy operations itself (forward mode and
#: higher derivatives too, on any device, with the memory of its saved chunk intermediates).
HOST_BACKWARD = None


def _host_backward(kwargs) -> bool:
    """The host backward applies: switched on, a named feature map, no packed batch (concrete positions and
    state, which the caller has checked)."""
    import jax

    on = HOST_BACKWARD if HOST_BACKWARD is not None else jax.default_backend() == "cpu"
    return bool(on) and isinstance(kwargs.get("feature_map", "elu"), str) and kwargs.get("cu_seqlens") is None \
        and kwargs.get("seqlen_offsets") is None


def _host_array(x):
    """A JAX array (concrete: inside a callback) as NumPy in a dtype the backends take (bfloat16 -> float32)."""
    a = np.asarray(x)
    return a if a.dtype in (np.float16, np.float32, np.float64) else a.astype(np.float32)


def _linear_attention_host_vjp(core, q, k, v, positions, kwargs):
    """``rotary.linear_attention`` on JAX arrays with a ``jax.custom_vjp``: the forward is the reference path's
    jax.numpy operations (``core``), the backward the frontend of the backend primitive
    (:func:`rotary.attn.linear_backward.linear_attention_backward`: Numba kernels where the backend has them,
    else the NumPy reference) on the host through ``jax.pure_callback`` (jit- and vmap-safe; vmap runs the
    callback per example). It saves q, k, v and the state passed in, nothing of the forward's chunks, and
    differentiates q, k, v and the state's S and z (the gradient of the returned state's S and z flows back
    too). Positions and every other argument are concrete (the caller checked). Not differentiable again and
    not in forward mode (``jax.jvp``): set :data:`HOST_BACKWARD` = False for those."""
    import jax

    from ..attn.linear_backward import linear_attention_backward
    from ..frontend.dispatch import with_arrays

    state = kwargs.get("state")
    return_state = kwargs.get("return_state", False)
    host_positions = positions if positions is None or isinstance(positions, (int, np.integer, np.ndarray)) \
        else np.asarray(positions)
    made = []

    def forward(q, k, v, S0, z0):
        st = None if state is None else with_arrays(state, S0, z0)
        o, st_out = core(q, k, v, positions, **dict(kwargs, state=st, return_state=True))
        made.append(st_out)                 # its static fields (spec, next position, ...) for the state returned
        return o, st_out.S, st_out.z

    def fwd(q, k, v, S0, z0):
        return forward(q, k, v, S0, z0), (q, k, v, S0, z0)

    def bwd(saved, cotangents):
        q, k, v, S0, z0 = saved
        go, gS, gz = cotangents
        want = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
        if state is not None:
            want += [jax.ShapeDtypeStruct(S0.shape, S0.dtype)] + (
                [] if z0 is None else [jax.ShapeDtypeStruct(z0.shape, z0.dtype)])

        def host(q, k, v, go, S0, z0, gS, gz):
            arrays = [_host_array(x) for x in (q, k, v, go)]
            st = None if state is None else with_arrays(state, _host_array(S0),
                                                        None if z0 is None else _host_array(z0))
            grad_state = None if gS is None else (_host_array(gS), None if gz is None else _host_array(gz))
            dq, dk, dv, dstate = linear_attention_backward(
                *arrays, host_positions, **dict(kwargs, state=st, backend="auto"),   # Numba where it has one
                grad_state=grad_state)
            out = [d.astype(w.dtype) for d, w in zip((dq, dk, dv), want)]
            if state is not None:
                out += [d.astype(w.dtype) for d, w in zip([x for x in dstate if x is not None], want[3:])]
            return tuple(out)

        got = jax.pure_callback(host, tuple(want), q, k, v, go, S0, z0, gS, gz, vmap_method="sequential")
        dS = dz = None
        if state is not None:
            dS = got[3]
            dz = None if z0 is None else got[4]
        return got[0], got[1], got[2], dS, dz

    f = jax.custom_vjp(forward)
    f.defvjp(fwd, bwd)
    S0, z0 = (None, None) if state is None else (state.S, state.z)
    o, S, z = f(q, k, v, S0, z0)
    if not return_state:
        return o
    return o, with_arrays(made[-1], S, z)


# -- the linear-attention state as a pytree (a scan / fori_loop carry) ----------------------------------
from ..attn.linear_state import register_jax_pytree  # noqa: E402

register_jax_pytree()   # already done where jax was imported before this module (rotary.attn.linear_state)

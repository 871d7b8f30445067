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
"""

from __future__ import annotations

import functools

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


def _rotate_traced(xs, names, positions, *, spec=None, seq_axis=-2, inverse=False, backend="auto",
                   spec_kwargs=None, **unknown):
    import jax.numpy as jnp

    from ..frontend import normalize as _api
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
                       spec.rotary_offset)
        results.append(_api.from_canonical(y, tuple(x.shape), ax, xp))
    return results


def linear_attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.linear_attention`` for JAX arrays: the reference path as JAX operations (concrete
    positions; the returned state holds JAX arrays)."""
    _check_backend(kwargs.get("backend", "auto"), ("q",))
    if positions is not None and _concrete_positions(positions) is None:
        raise ValueError("positions is traced: linear_attention under jit needs concrete positions (None, an int, "
                         "or a NumPy array; e.g. mark them static with static_argnums)")
    return core(q, k, v, positions, **dict(kwargs, backend="numpy"))

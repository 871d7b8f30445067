"""Dask adapter: Dask arrays in, Dask arrays out, lazily; each block runs the chosen backend's kernel.

Rotation (``apply``/``apply_qk``): one task per block (``da.blockwise``), the block rotated at its
global positions (None/int offsets become a lazy ``arange`` chunked like the sequence axis; NumPy or
Dask position arrays are rechunked to match). Output chunks equal input chunks; any axis but head_dim
may be chunked. Blocks may hold NumPy or CuPy arrays (``backend="auto"`` picks per block).

Linear attention, sequence axis chunked into blocks j = 0..n-1 (every other axis one chunk):

1. per block, in parallel: the block's own state ``st_j`` (a call with no carried state; causal=False
   unless decay is used, which is cheaper and gives the same sums);
2. an exclusive prefix of the states across blocks, ``P_(j+1) = gamma^(n_j) P_j + st_j`` (P_0 the
   caller's state or zero; gamma the per-head decay, n_j the block length), and for non-causal calls
   the suffix ``Q_j`` the same way from the end;
3. per block, in parallel: the block's output from one call with the carried state (causal: P_j;
   non-causal: P_j + Q_(j+1), every token of the call).

So a call is about 4n + n small tasks; step 1 and 3 are each as parallel as the blocks. The returned
state's S and z are Dask arrays (the last prefix).

Its backward (``rotary.attn.linear_backward.linear_attention_backward``, grad_o chunked like q) reuses steps 1
and 2, then per block, in parallel, the backward carrying the block's state (dq, the block's own dk and dv, and
its outputs' gradient at that state); those gradients summed across blocks (causal: a suffix from the last
block, decayed; non-causal: every other block's), and per block the part of dk and dv that reaches k and v
through the block's own sums (a backward with a zero grad_o and that gradient as ``grad_state``).
"""

from __future__ import annotations

import numbers

import numpy as np

from ..frontend.dispatch import with_arrays


def _da():
    import dask.array as da

    return da


def _is_dask(a) -> bool:
    return type(a).__module__.partition(".")[0] == "dask"


def _check_head_dim(x, name):
    if len(x.chunks[-1]) > 1:
        raise ValueError(f"{name} is chunked along head_dim (the last axis, chunks {x.chunks[-1]}); rotary needs "
                         f"whole head vectors in each block: rechunk with {name}.rechunk({{-1: -1}}) "
                         "(chunk the sequence axis instead)")


def _check_float(x, name):
    dtype = np.dtype(x.dtype)
    if dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"{name} must have a real floating dtype (float16/bfloat16/float32/float64), got {dtype}")


def _spec_of(kwargs, head_dim, name):
    from ..frontend.normalize import resolve_spec

    return resolve_spec(kwargs.get("spec"), kwargs.get("spec_kwargs") or {}, int(head_dim), name)


def _positions_array(positions, x, ax, spec, name="positions"):
    """(positions as a Dask int array chunked like x, its blockwise index) for a rotation of x."""
    da = _da()
    seq = x.shape[ax]
    coord = getattr(spec, "n_axes", 1) > 1
    if positions is None or isinstance(positions, (numbers.Integral, np.integer)) and not isinstance(positions, bool):
        start = 0 if positions is None else int(positions)
        if coord:
            raise ValueError(f"{name} must be an array of shape (seq, {spec.n_axes}) for a multi-axis spec")
        return da.arange(start, start + seq, chunks=(x.chunks[ax],), dtype=np.int64), (ax,)
    p = positions if _is_dask(positions) else da.from_array(np.asarray(_host(positions, name)))
    if p.dtype.kind not in "iu" and not getattr(spec, "float_positions", False):
        raise TypeError(f"{name} must have an integer dtype, got {p.dtype}")
    base = p.ndim - int(coord)
    tail = (p.shape[-1],) if coord else ()
    if base == 2 and ax > 0 and p.shape[:2] == (1, seq) and x.shape[0] != 1:   # one row for every batch entry
        p, base = p[0], 1
    if base == 1 and p.shape[0] == seq:
        index, chunks = (ax,), (x.chunks[ax],)
    elif base == 2 and ax > 0 and p.shape[:2] == (x.shape[0], seq):
        index, chunks = (0, ax), (x.chunks[0], x.chunks[ax])
    else:
        raise ValueError(f"{name} of shape {tuple(p.shape)} must be ({seq},{' n_axes' if coord else ''}) or "
                         f"(batch, {seq}{', n_axes' if coord else ''}) with batch = {name}'s x.shape[0]")
    if coord:
        index, chunks = index + (x.ndim,), chunks + (tail,)
    return p.rechunk(chunks), index


def _host(a, name):
    from ..spec.validators import to_numpy

    return to_numpy(a, name)


def _rotate_block(xb, pb, *, kwargs, label):
    from ..frontend.rotate import rotate_arrays

    return rotate_arrays([xb], [None], [label], pb, **kwargs)[0]


def rotate(core, xs, outs, names, positions, **kwargs):
    """``rotary.frontend.rotate.rotate_arrays`` for Dask arrays: one blockwise task per block."""
    da = _da()
    from ..frontend.normalize import normalize_seq_axis

    for x, name in zip(xs, names):
        if not _is_dask(x):
            raise TypeError(f"{name} must be a Dask array like {names[0]}, got {type(x).__name__}")
        _check_float(x, name)
        _check_head_dim(x, name)
    for out, name in zip(outs, names):
        if out is not None:
            raise TypeError(f"out= is not supported for Dask arrays (they are lazy): use the returned array for "
                            f"{name}, and dask.array.store(result, target) to write it into a buffer")
    x0 = xs[0]
    ax = normalize_seq_axis(kwargs.get("seq_axis"), x0.ndim, names[0])
    spec = _spec_of(kwargs, x0.shape[-1], names[0])
    block_kwargs = dict(kwargs, spec=spec, spec_kwargs={})
    if kwargs.get("tables") is not None:   # per-token tables made by the caller (rerotate): rows become positions
        positions, block_kwargs["tables"] = _fixed_tables(kwargs["tables"], spec, xs, ax)
    elif spec.depends_on_seq_len and not spec.float_positions:
        # a length-dependent rule (dynamic NTK, LongRoPE) takes its frequencies from the whole call's max
        # position + 1, not each block's: every block rotates with the frequencies of the whole call
        block_kwargs["spec"] = _at_seq_len(spec, _max_position(positions, x0, ax))
    results = []
    for x, name in zip(xs, names):
        if x.ndim != x0.ndim or x.shape[ax] != x0.shape[ax] or x.shape[-1] != x0.shape[-1]:
            raise ValueError(f"{name} of shape {x.shape} must match {names[0]} of shape {x0.shape} in the sequence "
                             "axis and head_dim")
        p, p_index = _positions_array(positions, x, ax, spec)
        index = tuple(range(x.ndim))
        results.append(da.blockwise(_rotate_block, index, x, index, p, p_index, dtype=x.dtype, meta=x._meta,
                                    concatenate=True, kwargs=block_kwargs, label=name))
    return results


def _max_position(positions, x, ax):
    """The largest position (any coordinate) of a rotation of x along axis ax, or None when it has none."""
    seq = x.shape[ax]
    if positions is None or isinstance(positions, (numbers.Integral, np.integer)) and not isinstance(positions, bool):
        return (0 if positions is None else int(positions)) + seq - 1 if seq else None
    p = positions if _is_dask(positions) else np.asarray(_host(positions, "positions"))
    if p.size == 0:
        return None
    hi = p.max()
    return int(hi.compute() if _is_dask(hi) else hi)


def _at_seq_len(spec, hi):
    """``spec`` with the frequencies and attention factor a length-dependent rule gives at max position
    ``hi`` (seq_len = hi + 1, as :func:`rotary.spec.tables.lookup` takes it for one call), fixed."""
    if hi is None or hi < 0:
        return spec
    seq_len = int(hi) + 1
    return spec.replace(scaling=None, frequencies=tuple(spec.inv_freq(seq_len).tolist()),
                        attention_factor=spec.attention_scaling_at(seq_len))


def _table_rows(cos, sin, _spec, pos, *, dtype, device_key=None, convert=None):
    convert = convert or (lambda a: a)
    return convert(cos.astype(dtype, copy=False)), convert(sin.astype(dtype, copy=False)), convert(pos)


def _fixed_tables(tables, spec, xs, ax):
    """(positions, tables) for blocks when the caller made per-token tables for the whole array: the
    tables are made once on the host, and each block's "positions" are its rows of them."""
    import functools

    x0 = xs[0]
    if getattr(spec, "n_axes", 1) > 1 or any(x.dtype != x0.dtype for x in xs):
        raise ValueError("per-token tables (rerotate) on Dask arrays need a one-axis spec and one dtype")
    work = np.float64 if x0.dtype == np.float64 else np.float32
    cos, sin, rows = tables(spec, None, dtype=work, device_key="cpu", convert=None)
    rows = np.asarray(rows)
    if rows.shape[0] == 1:
        rows = rows[0]
    elif ax == 0 or rows.shape[0] != x0.shape[0]:
        raise ValueError(f"per-token tables (rerotate) on Dask arrays take per-batch positions only along axis 0 "
                         f"(batch, seq); got rows of shape {rows.shape} for {tuple(x0.shape)}")
    return rows, functools.partial(_table_rows, np.asarray(cos), np.asarray(sin))


# -- linear attention ------------------------------------------------------------------------------
def _combine(prefix, st, length):
    """The state after ``prefix``'s tokens then a block of ``length`` tokens whose own state is ``st``."""
    if prefix is None or st is None:
        return st if prefix is None else prefix
    S, z = prefix.S, prefix.z
    if st.decay is not None and length:
        g = np.asarray(st.decay, dtype=np.float64) ** length
        S = S * g[..., None, None].astype(S.dtype)
        z = None if z is None else z * g[..., None].astype(z.dtype)
    return with_arrays(st, S + st.S, None if z is None else z + st.z)


def _block_state(q, k, v, p, kwargs):
    from ..attn.linear import linear_attention

    return linear_attention(q, k, v, p, **dict(kwargs, return_state=True, state=None))[1]


def _block_output(q, k, v, p, state, kwargs):
    from ..attn.linear import linear_attention

    return linear_attention(q, k, v, p, **dict(kwargs, state=state, return_state=False))


def _plan(core, q, k, v, positions, kwargs, others=()):
    """The graph's shared part for ``rotary.linear_attention`` (``core``, the forward's frontend) on Dask arrays
    q, k, v (and ``others``: (array, name) pairs chunked like q, e.g. grad_o), checked and rechunked along the
    sequence axis: per block its delayed arrays and positions, each block's own state (step 1) and the carried
    state of every block (step 2, causal: the prefix; non-causal: prefix and suffix). A namespace."""
    import types

    import dask

    from ..frontend.normalize import normalize_seq_axis

    arrays = [(q, "q"), (k, "k"), (v, "v"), *others]
    for a, name in arrays:
        if not _is_dask(a):
            raise TypeError(f"{name} must be a Dask array like q, got {type(a).__name__}")
        _check_float(a, name)
        _check_head_dim(a, name)
    ax = normalize_seq_axis(kwargs.get("seq_axis"), q.ndim, "q")
    for a, name in arrays:
        extra = [i for i in range(a.ndim) if i != ax and len(a.chunks[i]) > 1]
        if extra:
            raise ValueError(f"{name} is chunked along axes {extra}; linear_attention on Dask arrays chunks the "
                             f"sequence axis only: rechunk with {name}.rechunk({{{', '.join(f'{i}: -1' for i in extra)}}})")
    k, v = k.rechunk({ax: q.chunks[ax]}), v.rechunk({ax: q.chunks[ax]})
    others = [a.rechunk({ax: q.chunks[ax]}) for a, _ in others]
    causal = bool(kwargs.get("causal", False))
    state = kwargs.get("state")
    kwargs = {key: val for key, val in kwargs.items() if key not in ("state", "return_state")}

    # validate everything eagerly (and learn the state's fields) with a zero-length call on the host
    def empty(a):
        return np.zeros(tuple(0 if i == ax else n for i, n in enumerate(a.shape)), dtype=a.dtype)

    host_state = None
    if state is not None:
        host_state = with_arrays(state, np.zeros(state.S.shape, state.S.dtype),
                                 None if state.z is None else np.zeros(state.z.shape, state.z.dtype))
    host_positions = positions
    if positions is not None and not isinstance(positions, (numbers.Integral, np.integer)):
        host_positions = None
    _, template = core(empty(q), empty(k), empty(v), host_positions, **dict(kwargs, state=host_state,
                                                                              return_state=True))
    spec = template.spec
    seq = q.shape[ax]
    bounds = np.cumsum((0,) + q.chunks[ax])

    # per-block positions (ints, host slices or Dask blocks) and the next position after the call
    from_state = positions is None and state is not None
    if from_state:
        positions = state.next_position
    if positions is None or isinstance(positions, (numbers.Integral, np.integer)) and not isinstance(positions, bool):
        start = 0 if positions is None else int(positions)
        blocks_p = [start + int(b) for b in bounds[:-1]]
        next_position = start + seq
    elif from_state:
        starts = positions.astype(np.int64)                      # a state's per-batch next positions
        blocks_p = [starts[:, None] + np.arange(s0, s1, dtype=np.int64)[None, :] for s0, s1 in zip(bounds[:-1], bounds[1:])]
        next_position = starts + seq
    else:
        coord = getattr(spec, "n_axes", 1) > 1
        p = positions if _is_dask(positions) else np.asarray(_host(positions, "positions"))
        dim = 0 if p.ndim - int(coord) == 1 else 1
        if p.shape[dim] != seq:
            raise ValueError(f"positions of shape {tuple(p.shape)} do not match the sequence length {seq}")
        if _is_dask(p):
            p = p.rechunk({dim: q.chunks[ax], **{i: -1 for i in range(p.ndim) if i != dim}})
            blocks_p = list(p.to_delayed().reshape(-1))
        else:
            blocks_p = [p[(slice(None),) * dim + (slice(s0, s1),)] for s0, s1 in zip(bounds[:-1], bounds[1:])]
        last = p[(slice(None),) * dim + (-1,)]
        last = np.asarray(last.compute() if _is_dask(last) else last)
        if coord:
            next_position = template.next_position
        else:
            next_position = int(last) + 1 if last.ndim == 0 else last.astype(np.int64) + 1

    frozen = None
    if spec.depends_on_seq_len and not spec.float_positions and seq:
        # a length-dependent rule (dynamic NTK, LongRoPE) takes its frequencies from the whole call's max
        # position + 1 (as one NumPy call does), not each block's: every block runs with those frequencies
        if positions is None or isinstance(positions, (numbers.Integral, np.integer)) and not isinstance(positions, bool):
            hi = (0 if positions is None else int(positions)) + seq - 1
        elif from_state:
            hi = int(np.max(positions)) + seq - 1
        else:
            hi = _max_position(positions, q, ax)
        frozen = _at_seq_len(spec, hi)
        from ..spec.rope_spec import RopeSpec
        import inspect

        spec_keys = set(inspect.signature(RopeSpec.__init__).parameters) - {"self"}
        kwargs = {key: val for key, val in kwargs.items() if key not in spec_keys and key != "spec_kwargs"}
        kwargs["spec"] = frozen

    blocks = [tuple(a.to_delayed().reshape(-1)) for a in (q, k, v)]
    n = len(bounds) - 1
    lengths = [int(b1 - b0) for b0, b1 in zip(bounds[:-1], bounds[1:])]
    decayed = template.decay is not None and bool(np.any(template.decay != 1))
    state_kwargs = dict(kwargs, causal=causal if decayed else False)
    block_state = dask.delayed(_block_state, pure=True)
    own = [block_state(blocks[0][j], blocks[1][j], blocks[2][j], blocks_p[j], state_kwargs) for j in range(n)]
    combine = dask.delayed(_combine, pure=True)
    prefix = [None]
    if state is not None:   # the caller's state (its arrays become dependencies when they are Dask arrays)
        rebuild, args = state.__reduce__()
        if frozen is not None:   # the blocks' spec (args[3] is the state's spec)
            args = args[:3] + (frozen,) + args[4:]
        prefix = [dask.delayed(rebuild, pure=True)(state.S, state.z, *args[2:])]
    for j in range(n):
        prefix.append(combine(prefix[-1], own[j], lengths[j]))
    if causal:
        carried = prefix[:n]
    else:   # no decay here (the core refuses decay < 1 without causal): every other block's tokens
        suffix = [None] * (n + 1)
        for j in range(n - 1, 0, -1):
            suffix[j] = combine(suffix[j + 1], own[j], 0)
        carried = [combine(prefix[j], suffix[j + 1], 0) if j < n - 1 else prefix[j] for j in range(n)]
    return types.SimpleNamespace(ax=ax, k=k, v=v, others=others, causal=causal, state=state, kwargs=kwargs,
                                 template=template, blocks=blocks, blocks_p=blocks_p, lengths=lengths, n=n,
                                 decayed=decayed, prefix=prefix, carried=carried, next_position=next_position,
                                 host_state=host_state, host_positions=host_positions, empty=empty)


def linear_attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.linear_attention`` for Dask arrays chunked along the sequence axis (see module docstring)."""
    if kwargs.pop("save_for_backward", False):   # the blocks' states are the graph's own: nothing saved here
        from ..attn.linear import nothing_saved

        return nothing_saved(linear_attention(core, q, k, v, positions, **kwargs), kwargs.get("return_state"))
    da = _da()
    import dask

    return_state = kwargs.get("return_state", False)
    plan = _plan(core, q, k, v, positions, kwargs)
    ax, n, lengths, blocks, blocks_p, carried, kwargs = (plan.ax, plan.n, plan.lengths, plan.blocks, plan.blocks_p,
                                                         plan.carried, plan.kwargs)
    template, prefix, next_position = plan.template, plan.prefix, plan.next_position
    output = dask.delayed(_block_output, pure=True)
    dv = v.shape[-1]
    o_blocks = []
    for j in range(n):
        o = output(blocks[0][j], blocks[1][j], blocks[2][j], blocks_p[j], carried[j], kwargs)
        shape = tuple(lengths[j] if i == ax else (dv if i == q.ndim - 1 else s) for i, s in enumerate(q.shape))
        o_blocks.append(da.from_delayed(o, shape, dtype=q.dtype, meta=q._meta))
    o = da.concatenate(o_blocks, axis=ax) if n else da.zeros(q.shape[:-1] + (dv,), dtype=q.dtype, chunks=q.chunks[:-1] + ((dv,),))
    if not return_state:
        return o
    final = prefix[n]
    S = da.from_delayed(dask.delayed(getattr)(final, "S"), template.S.shape, dtype=template.S.dtype,
                        meta=q._meta.astype(template.S.dtype))
    z = None if template.z is None else da.from_delayed(dask.delayed(getattr)(final, "z"), template.z.shape,
                                                        dtype=template.z.dtype, meta=q._meta.astype(template.z.dtype))
    rebuild, args = template.__reduce__()
    return o, rebuild(S, z, next_position, *args[3:])


# -- linear attention's backward -------------------------------------------------------------------------------
def _block_backward(q, k, v, g, p, state, grad_state, kwargs):
    from ..attn.linear_backward import linear_attention_backward

    return linear_attention_backward(q, k, v, g, p, **dict(kwargs, state=state, grad_state=grad_state))


def _state_path(q, k, v, g, p, grad_state, kwargs):
    """(dk, dv) of a block through its own state alone: the backward with a zero grad_o (dq is then 0)."""
    from ..attn.linear_backward import linear_attention_backward

    return linear_attention_backward(q, k, v, np.zeros_like(g), p, **dict(kwargs, state=None,
                                                                          grad_state=grad_state))[1:3]


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _grad_combine(later, own, length, decay):
    """The gradient (dS, dz) at the state before a block of ``length`` tokens: ``own`` (the block's outputs'
    gradient at its input state) plus gamma^length ``later`` (the gradient at the state after it); None: zero."""
    if later is not None and decay is not None and length:
        g = np.asarray(decay, dtype=np.float64) ** length
        later = tuple(None if x is None else x * g.reshape(g.shape + (1,) * (x.ndim - g.ndim)).astype(x.dtype)
                      for x in later)
    if later is None or own is None:
        return own if later is None else later
    return tuple(_add(a, b) for a, b in zip(later, own))


def _pick(result, i):
    return result[i]


def linear_attention_backward(core, q, k, v, grad_o, positions=None, **kwargs):
    """``rotary.attn.linear_backward.linear_attention_backward`` for Dask arrays chunked along the sequence axis,
    as the forward (see docs/dask.md): the forward's states and carried states (steps 1, 2), then per block in
    parallel the backward carrying its state, which gives dq, the block's own dk, dv and the gradient at its
    carried state; those gradients summed across blocks (causal: a suffix from the last block, decayed;
    non-causal: every other block's), and per block the part of dk, dv that reaches k, v through its state (a
    backward with a zero grad_o). dq, dk, dv chunked like q (along the sequence axis), dstate Dask arrays."""
    if kwargs.pop("saved", None) is not None:
        raise ValueError("saved: a Dask forward keeps no chunk states (it returns None for save_for_backward)")
    da = _da()
    import dask

    from ..attn.linear import linear_attention as forward

    grad_state = kwargs.get("grad_state")
    kwargs = {key: val for key, val in kwargs.items() if key not in ("grad_state", "return_state")}
    if grad_state is not None and not isinstance(grad_state, (tuple, list)) and hasattr(grad_state, "S"):
        grad_state = (grad_state.S, grad_state.z)
    plan = _plan(forward.core, q, k, v, positions, kwargs, others=[(grad_o, "grad_o")])
    ax, n, lengths, blocks, blocks_p, carried = plan.ax, plan.n, plan.lengths, plan.blocks, plan.blocks_p, plan.carried
    bkwargs, template, causal = plan.kwargs, plan.template, plan.causal
    g = plan.others[0]
    # the backward's own checks (grad_o's shape, grad_state's, the feature map), eagerly on zero-length arrays
    host_grad = None
    if grad_state is not None:
        if not isinstance(grad_state, (tuple, list)) or len(grad_state) != 2:
            raise TypeError("grad_state must be None or a pair (G_S, G_z) of arrays (either None), the gradient at "
                            f"the returned state's S and z; got {type(grad_state).__name__}")
        host_grad = tuple(None if x is None else np.zeros(tuple(x.shape), np.dtype(x.dtype)) for x in grad_state)
    core(plan.empty(q), plan.empty(k), plan.empty(v), plan.empty(grad_o), plan.host_positions,
         **dict(kwargs, state=plan.host_state, grad_state=host_grad))
    if grad_state is not None:   # Dask (or host) arrays, one block each: dependencies of the graph
        grad_state = tuple(None if x is None else (x.rechunk(-1) if _is_dask(x) else x) for x in grad_state)
    g_blocks = tuple(g.to_delayed().reshape(-1))
    decay = template.decay if plan.decayed else None
    backward = dask.delayed(_block_backward, pure=True)
    pick = dask.delayed(_pick, pure=True)
    combine = dask.delayed(_grad_combine, pure=True)
    # per block: dq, its own dk, dv and its outputs' gradient at its carried state (None without one)
    first = [backward(blocks[0][j], blocks[1][j], blocks[2][j], g_blocks[j], blocks_p[j], carried[j], None, bkwargs)
             for j in range(n)]
    own = [None if carried[j] is None else pick(first[j], 3) for j in range(n)]
    # the gradient at the state each block's tokens add to (causal: the state after block j; non-causal: the sum
    # of every block's tokens, through every other block's carried state), and at the state passed in
    given = None if grad_state is None else dask.delayed(tuple, pure=True)(list(grad_state))
    if causal:
        after = [None] * n
        if n:
            after[n - 1] = given
        for j in range(n - 2, -1, -1):
            after[j] = combine(after[j + 1], own[j + 1], lengths[j + 1], decay)
        d_in = combine(after[0], own[0], lengths[0], decay) if n else given
    else:
        pre, suf = [None] * (n + 1), [None] * (n + 1)
        for j in range(n):
            pre[j + 1] = combine(pre[j], own[j], 0, None)
        for j in range(n - 1, -1, -1):
            suf[j] = combine(suf[j + 1], own[j], 0, None)
        after = [combine(combine(pre[j], suf[j + 1], 0, None), given, 0, None) for j in range(n)]
        d_in = combine(pre[n], given, 0, None)
    path_kwargs = dict(bkwargs, causal=causal if plan.decayed else False)
    if not plan.decayed:
        path_kwargs.pop("decay", None)
    state_path = dask.delayed(_state_path, pure=True)
    add = dask.delayed(_add, pure=True)
    outs = ([], [], [])
    for j in range(n):
        dq_j, dk_j, dv_j = (pick(first[j], i) for i in range(3))
        if grad_state is not None or (j < n - 1 if causal else n > 1):   # (else no gradient reaches its sums)
            path = state_path(blocks[0][j], blocks[1][j], blocks[2][j], g_blocks[j], blocks_p[j], after[j],
                              path_kwargs)
            dk_j, dv_j = add(dk_j, pick(path, 0)), add(dv_j, pick(path, 1))
        for out, d, like in zip(outs, (dq_j, dk_j, dv_j), (q, plan.k, plan.v)):
            shape = tuple(lengths[j] if i == ax else s for i, s in enumerate(like.shape))
            out.append(da.from_delayed(d, shape, dtype=like.dtype, meta=like._meta))
    grads = tuple(da.concatenate(out, axis=ax) if n else da.zeros(like.shape, dtype=like.dtype, chunks=like.chunks)
                  for out, like in zip(outs, (q, plan.k, plan.v)))
    if plan.state is None:
        return grads + (None,)
    dS = da.from_delayed(dask.delayed(_pick)(d_in, 0), template.S.shape, dtype=template.S.dtype,
                         meta=q._meta.astype(template.S.dtype))
    dz = None
    if template.z is not None:
        dz = da.from_delayed(dask.delayed(_pick)(d_in, 1), template.z.shape, dtype=template.z.dtype,
                             meta=q._meta.astype(template.z.dtype))
    return grads + ((dS, dz),)

"""The KV primitives planned once per step and run per layer (FlashInfer's plan / run, for an engine with its own
tables): :func:`prepare_kv_append` and :func:`prepare_paged_attention` make every check of a
:func:`rotary.kv_append` / :func:`rotary.paged_attention` call once (arrays, spec, format and backend, the slots or
the block table, the rotation tables) and return an object that runs it over each layer's pools.

Each run takes arrays shaped, strided and typed as the prepared ones and pools of the prepared geometry (another
geometry is refused, naming the argument: prepare again), re-checks what a plan re-checks on every call (an append's
pools writable, the memory k, v and the norm weights share with the pools: refused; attention only reads the pools)
and takes the layer's norm weights. Host slots, positions and tables are copied when preparing: changing the
caller's arrays afterwards changes nothing. Device (CuPy) tables are the caller's to keep, as for the stateless
calls.

::

    append = rotary.prepare_kv_append(k, v, k_pools[0], v_pools[0], slot_mapping, positions, spec=spec)
    attend = rotary.prepare_paged_attention(q, k_pools[0], v_pools[0], block_table, seq_lens, spec=spec)
    for i in range(layers):
        append(k[i], v[i], k_pools[i], v_pools[i])
        o = attend(q[i], k_pools[i], v_pools[i])
"""

from __future__ import annotations

from .primitives import append_setup, attention_setup, check_memory, contiguous, flat_stores, packed_queries


def _geometry(a):
    """(type, dtype, shape, strides) of a NumPy or CuPy array; None for anything else."""
    if not hasattr(a, "strides") or not hasattr(a, "dtype"):
        return None
    return type(a), a.dtype, a.shape, a.strides


def _described(geometry):
    if geometry is None:
        return "not an array"
    kind, dtype, shape, strides = geometry
    return f"{kind.__module__}.{kind.__name__} {dtype} {shape} strides {strides}"


def _named_pools(k_pool, v_pool, scales):
    named = [("k_pool", k_pool), ("v_pool", v_pool)]
    return named if scales is None else named + [("scales[0]", scales[0]), ("scales[1]", scales[1])]


class _Prepared:
    """What both prepared primitives keep: the plan, the backend's run, and the geometry (type, dtype, shape,
    strides) of the arrays, pools and scales they were prepared for, with their names."""

    __slots__ = ("_plan", "_run", "_names", "_geometries")

    def _record(self, plan, run, names, arrays, k_pool, v_pool, scales):
        self._plan, self._run = plan, run
        named = list(zip(names, arrays)) + _named_pools(k_pool, v_pool, scales)
        self._names = tuple(name for name, _ in named)
        self._geometries = tuple(_geometry(a) for _, a in named)

    def _check(self, arrays):
        """``arrays`` (the run's inputs, pools and scales, in the prepared order) have the prepared geometry."""
        try:
            same = tuple((type(a), a.dtype, a.shape, a.strides) for a in arrays) == self._geometries
        except AttributeError:
            same = False
        if not same:
            self._refuse(arrays)

    def _refuse(self, arrays):
        """ValueError naming the first array whose geometry differs from the prepared one (a call of another
        geometry is prepared anew)."""
        for name, a, want in zip(self._names, arrays, self._geometries):
            got = _geometry(a)
            if got != want:
                raise ValueError(f"{name} is {_described(got)}, but this call was prepared for {_described(want)}: "
                                 "prepare another")

    def _arrays(self, inputs, k_pool, v_pool, scales):
        """The run's arrays in the prepared order, scales given as prepared (None, or a pair)."""
        if (scales is None) != (len(self._geometries) == len(inputs) + 2):
            raise ValueError("scales must be (k_scales, v_scales) as prepared (a quantized kv_dtype)" if scales is None
                             else "scales goes with a quantized kv_dtype, and this call was prepared without")
        if scales is None:
            return (*inputs, k_pool, v_pool)
        if not isinstance(scales, (tuple, list)) or len(scales) != 2:
            raise TypeError(f"scales must be (k_scales, v_scales), got {type(scales).__name__}")
        return (*inputs, k_pool, v_pool, scales[0], scales[1])


class PreparedKVAppend(_Prepared):
    """:func:`rotary.kv_append` prepared once (:func:`prepare_kv_append`): ``append(k, v, k_pool, v_pool,
    scales=None, *, k_norm=None, norm_eps=None)`` writes ``k_pool[slot] = Q(R(p) N(k))``, ``v_pool[slot] = Q(v)`` at
    the prepared slots and positions, into the pools given (each layer's)."""

    __slots__ = ()

    def __call__(self, k, v, k_pool, v_pool, scales=None, *, k_norm=None, norm_eps=None):
        self._check(self._arrays((k, v), k_pool, v_pool, scales))
        norm = self._plan.norm(k_norm, norm_eps, "k_norm")
        check_memory((k, v) if norm is None else (k, v, norm[0]), ("k", "v", "k_norm"), k_pool, v_pool, scales)
        self._run(k, v, flat_stores(k_pool, v_pool, scales), norm)


class PreparedPagedAttention(_Prepared):
    """:func:`rotary.paged_attention` prepared once (:func:`prepare_paged_attention`): ``attend(q, k_pool, v_pool,
    scales=None, *, q_norm=None, norm_eps=None) -> o`` over the prepared block table and lengths, in the pools given
    (each layer's, only read); o shaped as q."""

    __slots__ = ("_packed",)

    def __call__(self, q, k_pool, v_pool, scales=None, *, q_norm=None, norm_eps=None):
        self._check(self._arrays((q,), k_pool, v_pool, scales))
        norm = self._plan.norm(q_norm, norm_eps, "q_norm")
        qp = q if self._packed else q.reshape(-1, q.shape[2], q.shape[3])   # (n, s, Hq, D) -> (n * s, Hq, D)
        o = self._run(contiguous(qp), flat_stores(k_pool, v_pool, scales), norm)
        return o if self._packed else o.reshape(q.shape)


def prepare_kv_append(k, v, k_pool, v_pool, slots, positions, *, spec, scales=None, kv_dtype=None,
                      backend="auto") -> PreparedKVAppend:
    """:func:`rotary.kv_append`'s call checked and prepared once (a step's slots and positions), to run for every
    layer: ``append(k, v, k_pool, v_pool, scales=None, *, k_norm=None, norm_eps=None)``, with k, v shaped, strided
    and typed as these and pools of these pools' geometry (see :mod:`rotary.kvcache.prepared`). The arguments are
    :func:`rotary.kv_append`'s; ``k``, ``v``, the pools and scales here only give the geometry (nothing is
    written)."""
    plan, run = append_setup(k, v, k_pool, v_pool, slots, positions, spec=spec, scales=scales, kv_dtype=kv_dtype,
                             backend=backend, keep=True)
    prepared = PreparedKVAppend()
    prepared._record(plan, run, ("k", "v"), (k, v), k_pool, v_pool, scales)
    return prepared


def prepare_paged_attention(q, k_pool, v_pool, block_table, seq_lens, *, spec=None, cu_seqlens=None, q_positions=None,
                            causal=True, window=None, softcap=None, scale=None, scales=None, kv_dtype=None,
                            backend="auto") -> PreparedPagedAttention:
    """:func:`rotary.paged_attention`'s call checked and prepared once (a step's block table, lengths and queries'
    rotation), to run for every layer: ``attend(q, k_pool, v_pool, scales=None, *, q_norm=None, norm_eps=None) -> o``,
    with q shaped, strided and typed as this one and pools of these pools' geometry (see
    :mod:`rotary.kvcache.prepared`). The arguments are :func:`rotary.paged_attention`'s; ``q``, the pools and scales
    here only give the geometry (nothing is read)."""
    qp, counts, dense_shape = packed_queries(q, cu_seqlens)
    plan, run = attention_setup(qp, counts, dense_shape, k_pool, v_pool, block_table, seq_lens, spec=spec,
                                q_positions=q_positions, causal=causal, window=window, softcap=softcap, scale=scale,
                                scales=scales, kv_dtype=kv_dtype, backend=backend, keep=True)
    prepared = PreparedPagedAttention()
    prepared._record(plan, run, ("q",), (q,), k_pool, v_pool, scales)
    prepared._packed = cu_seqlens is not None
    return prepared


__all__ = ["PreparedKVAppend", "PreparedPagedAttention", "prepare_kv_append", "prepare_paged_attention"]

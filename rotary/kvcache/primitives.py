"""Stateless KV primitives over caller-owned pools and tables: :func:`kv_append` and :func:`paged_attention`.

An engine keeps its own scheduler, pools and tables and calls these (FlashInfer's shape); :class:`rotary.KVCache`
is a thin owner of pools, tables and lengths over the same plans.

Pools are ``(num_pages, page_size, kv_heads, head_dim)`` (vLLM's flash layout), C-contiguous; a *slot* indexes
their flat ``(num_pages * page_size, kv_heads, head_dim)`` view, ``slot = page * page_size + offset``. Quantized
pools (``kv_dtype`` "int8" / "float8_e4m3", :data:`rotary.backends.kv_entries.KV_FORMATS`) come with
``scales = (k_scales, v_scales)``, each ``(num_pages, page_size, kv_heads)`` in the work dtype (float32; float64
for float64 keys).

Append (token t): ``k_pool.flat[slots[t]] = Q(R(positions[t]) k[t])``, ``v_pool.flat[slots[t]] = Q(v[t])`` with R
the spec's rotation and Q the format's rounding; ``slots[t] = -1`` is a padding token (skipped).

Attention (sequence i, its queries j = 0..c_i-1 at positions ``p = seq_lens[i] - c_i + j``)::

    o = sum_t softmax_t(cap(scale <R_p q, k_t>) + mask) v_t,   t < seq_lens[i],  k_t in slot
        block_table[i, t // page_size] * page_size + t % page_size

with the causal mask ``t <= p`` (and ``p - t < window``), ``cap(x) = c tanh(x / c)`` for ``softcap=c``.

Qwen3 and Gemma 3 normalize each q and k head before RoPE (``q_norm`` / ``k_norm``): given weights, the kernels
apply ``N(x)_j = (x_j * inv) * weight_j``, ``inv = 1 / sqrt(sum_j x_j^2 / head_dim + eps)`` in the work dtype
before the rotation, in the same pass (k as it is appended, q as the attention reads it): ``R(p) N(k)`` is rounded
once, where a separate norm pass would round N(k) to k's dtype first.

Both are planned once per geometry (:class:`KVPlan`: array types, dtypes and shapes, the spec against head_dim,
the KV format, the backend with the format as a variant of its capability, where its cos/sin tables live); every
call re-checks what can change under the same geometry: the pools' writeable flag and the memory k and v share
with the pools (refused), and, for host tables, the slots and pages named (in the pool, distinct slots). Device
tables (CuPy) are the caller's to keep in range, as FlashInfer's and vLLM's are. A plan then prepares the backend's
call (:meth:`KVPlan.prepare_append`, :meth:`KVPlan.prepare_attention`: the tables, q's rotation, which the attention
kernel applies as it reads q, and the kernel's arguments), which :class:`rotary.KVCache` runs for every layer of a
step.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backends as _backends
from ..backends.kv_entries import kv_format
from ..frontend.arguments import namespace, pick_backend, resolve_spec, table_converter
from ..frontend.buffers import overlaps
from ..frontend.positions import normalize_positions
from ..spec import tables as _tables
from ..spec.packing import check_cu_seqlens, host_int_array
from ..spec.rope_spec import RopeSpec
from ..spec.validators import check_float, optional_number

_PLANS_MAX = 64
#: the eps of q_norm / k_norm when norm_eps is not given (Qwen3's and Gemma 3's rms_norm_eps)
NORM_EPS = 1e-6
_plans: dict = {}
_may_share = np.may_share_memory


def _is_host(a) -> bool:
    return isinstance(a, np.ndarray)


def _keyable(arrays) -> bool:
    """NumPy or CuPy arrays (a plan key holds their type, dtype, shape and strides)."""
    for a in arrays:
        if type(a) is not np.ndarray and not type(a).__module__.startswith("cupy"):
            return False
    return isinstance(arrays, (tuple, list))


def _part(a):
    return type(a), a.dtype, a.shape, a.strides


class KVPlan:
    """What the checks of one KV geometry proved: pools ``(num_pages, page_size, kv_heads, head_dim)`` of entry
    format ``fmt`` for ``dtype`` data, the spec (None: no rotation), the backend ``module`` (its ``append_kv`` /
    ``paged_attention`` with this format), and where its cos/sin tables live."""

    __slots__ = ("fmt", "dtype", "work", "shape", "spec", "module", "device_key", "convert", "dense_key", "xp",
                 "last_append")

    @property
    def slots_total(self) -> int:
        return self.shape[0] * self.shape[1]

    # -- tables ---------------------------------------------------------------------------------------------------
    def tables(self, positions, token_positions, bounds=None):
        """(cos, sin, rows) of the work dtype for host positions: 1-D int64 token positions (``token_positions``;
        the shared dense table when it holds them; ``bounds``: their (min, max) when the caller knows them) or
        normalized positions (1, T[, n_axes])."""
        if token_positions and self.dense_key is not None and positions.size:
            entry = _tables.cached_dense(self.dense_key)
            if entry is not None:
                lo, hi = bounds if bounds is not None else value_range(positions)
                if lo >= 0 and hi < entry[0]:
                    rows = positions if self.convert is None else self.convert(positions)
                    return entry[1], entry[2], rows
        cos, sin, rows = _tables.lookup(self.spec, positions[None] if token_positions else positions,
                                        dtype=self.work, device_key=self.device_key, convert=self.convert)
        return cos, sin, rows.reshape(-1)

    def rotation(self, positions, token_positions=True, bounds=None):
        """The backends' ``rotation`` argument, ``(cos, sin, rows, rotary_dim, layout, offset)``, of the spec at host
        positions (as :meth:`tables` takes them); None without a spec."""
        if self.spec is None:
            return None
        cos, sin, rows = self.tables(positions, token_positions, bounds)
        spec = self.spec
        return cos, sin, rows, spec.rotary_dim, spec.layout, spec.rotary_offset

    def norm(self, weight, eps, name):
        """The backends' ``norm`` argument of a per-head RMSNorm (:func:`norm_argument`) for this plan's arrays."""
        return norm_argument(weight, eps, name, self.shape[3], self.work, None if self.convert is None else self.xp)

    # -- running ---------------------------------------------------------------------------------------------------
    def prepare_append(self, k, v, slots, rotation, previous=None):
        """``run(k, v, stores, norm=None)``: the backend's append_kv of keys and values shaped and strided as ``k``,
        ``v`` into host int64 ``slots`` (checked) at ``rotation`` (:meth:`rotation`), for the stores of any layer and
        its ``norm`` (:meth:`norm`; its ``prepare_append_kv`` capability where it has one). ``previous``: a run this
        plan prepared for keys of the same geometry (a decode chain's last step), moved to these slots and rows
        when the backend's run can be (``run.moved``; by default the last run this plan prepared: its keys have this
        plan's geometry too)."""
        if self.convert is not None:
            slots = self.convert(slots)
        cos, sin, rows, rotary_dim, layout, offset = rotation
        moved = getattr(self.last_append if previous is None else previous, "moved", None)
        if moved is not None:
            run = moved(cos, sin, rows, slots)
            if run is not None:
                return run
        prepare = getattr(self.module, "prepare_append_kv", None)
        if prepare is not None:
            run = self.last_append = prepare(k, v, cos, sin, rows, slots, rotary_dim=rotary_dim, layout=layout,
                                             offset=offset, kv_dtype=self.fmt.name)
            return run
        options = dict(rotary_dim=rotary_dim, layout=layout, offset=offset, kv_dtype=self.fmt.name)
        append_kv = self.module.append_kv
        return lambda k, v, stores, norm=None: append_kv(k, v, cos, sin, rows, slots, stores, norm=norm, **options)

    def prepare_attention(self, q, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal,
                          rotation):
        """``run(q, stores, norm=None) -> o``: the backend's paged_attention of C-contiguous packed q (T, Hq, D) shaped
        as ``q`` over these tables (host tables converted to the backend's arrays), q normed (``norm``:
        :meth:`norm`) and rotated in the kernel at ``rotation`` (None: q is rotated), for the stores of any layer (its
        ``prepare_paged_attention`` capability where it has one)."""
        if self.convert is not None:
            block_table, seq_lens, q_starts = (a if not _is_host(a) else self.convert(a)
                                               for a in (block_table, seq_lens, q_starts))
        prepare = getattr(self.module, "prepare_paged_attention", None)
        if prepare is not None:
            return prepare(q, block_table, page_size, seq_lens, q_starts, scale=scale, softcap=softcap, window=window,
                           causal=causal, kv_dtype=self.fmt.name, rotation=rotation)
        options = dict(scale=scale, softcap=softcap, window=window, causal=causal, kv_dtype=self.fmt.name,
                       rotation=rotation)
        attend = self.module.paged_attention
        return lambda q, stores, norm=None: attend(q, stores, block_table, page_size, seq_lens, q_starts, norm=norm,
                                                   **options)


def norm_argument(weight, eps, name, head_dim, work, xp=None):
    """The backends' ``norm`` argument of a per-head RMSNorm with ``weight`` (``name``: "k_norm" or "q_norm"):
    ``(weight (head_dim,) C-contiguous in the ``work`` dtype, eps)``, a NumPy array (``xp`` None) or one of ``xp``'s
    (a device backend's namespace); None without a weight (then ``eps`` must be None too)."""
    if weight is None:
        if eps is not None:
            raise ValueError(f"norm_eps goes with {name}= (the norm's weights); without them nothing is normed")
        return None
    if eps is None:
        eps = NORM_EPS
    elif type(eps) is not float or not 0.0 <= eps < math.inf:   # (a finite float >= 0 as it is: a decode step's)
        eps = optional_number(eps, "norm_eps", positive=False)
        if eps < 0:
            raise ValueError(f"norm_eps must be >= 0, got {eps}")
    if xp is None and type(weight) is np.ndarray and weight.dtype == work and weight.shape == (head_dim,) and \
            weight.flags.c_contiguous:
        return weight, eps   # (read, never written)
    if not hasattr(weight, "shape") or not hasattr(weight, "dtype"):
        raise TypeError(f"{name} must be an array of head_dim ({head_dim}) weights, got {type(weight).__name__}")
    if tuple(weight.shape) != (head_dim,):
        raise ValueError(f"{name} must have shape ({head_dim},) (one weight per coordinate of a head), got "
                         f"{tuple(weight.shape)}")
    w = np.asarray(weight) if xp is None else xp.asarray(weight)
    check_float(w, name, np if xp is None else xp)
    w = w.astype(work) if w.dtype != work else w
    return (w if w.flags.c_contiguous else w.copy()), eps


def value_range(a):
    """(min, max) of a non-empty host int array: in Python for decode-sized arrays (cheaper than two NumPy
    reductions)."""
    if a.size <= 64:
        values = a.tolist()
        return min(values), max(values)
    return int(a.min()), int(a.max())


def check_pools(k_pool, v_pool, scales, *, dtype, kv_dtype, head_dim=None, kv_heads=None, x="k"):
    """The pools' and scales' geometry for data of float ``dtype`` (array name ``x`` in errors): 4-D, the same
    shape, C-contiguous, the format's entry dtype, scales (num_pages, page_size, kv_heads) in the work dtype for a
    quantized format, else None. Returns (format, shape, work dtype)."""
    fmt = kv_format(kv_dtype)
    dtype = np.dtype(dtype)
    work = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    if fmt.fp32_work_only and work == np.float64:
        raise ValueError(f"kv_dtype={kv_dtype!r} entries are rounded from float32 values: {x} must be float16 or "
                         "float32 (use kv_dtype='int8' for float64)")
    for pool, name in ((k_pool, "k_pool"), (v_pool, "v_pool")):
        if not hasattr(pool, "shape") or not hasattr(pool, "flags"):
            raise TypeError(f"{name} must be a NumPy or CuPy array (num_pages, page_size, kv_heads, head_dim) that "
                            f"rotary writes in place, got {type(pool).__module__}.{type(pool).__name__}")
        if pool.ndim != 4:
            raise ValueError(f"{name} must be 4-D (num_pages, page_size, kv_heads, head_dim), got shape "
                             f"{tuple(pool.shape)}")
    shape = tuple(int(n) for n in k_pool.shape)
    if tuple(v_pool.shape) != shape:
        raise ValueError(f"v_pool {tuple(v_pool.shape)} must have k_pool's shape {shape}")
    if head_dim is not None and (shape[3] != head_dim or (kv_heads is not None and shape[2] != kv_heads)):
        raise ValueError(f"{x} has {kv_heads} heads of size {head_dim} but the pools hold {shape[2]} heads of size "
                         f"{shape[3]} (num_pages, page_size, kv_heads, head_dim) = {shape}")
    entry = dtype if fmt.entry is None else np.dtype(fmt.entry)
    for pool, name in ((k_pool, "k_pool"), (v_pool, "v_pool")):
        if np.dtype(pool.dtype) != entry:
            why = (f"{x}'s dtype" if fmt.entry is None else f"the entries of kv_dtype={kv_dtype!r}")
            raise TypeError(f"{name} has dtype {pool.dtype}; {why} is {entry}")
        if not pool.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (slots index its flat view)")
    if fmt.limit is None:
        if scales is not None:
            raise ValueError("scales= goes with a quantized kv_dtype ('int8', 'float8_e4m3'); these pools hold "
                             f"{entry} values")
        return fmt, shape, work
    if not isinstance(scales, (tuple, list)) or len(scales) != 2:
        raise TypeError(f"kv_dtype={kv_dtype!r} needs scales=(k_scales, v_scales), each (num_pages, page_size, "
                        f"kv_heads) {work.name}; got {type(scales).__name__}")
    for a, name in zip(scales, ("scales[0] (k)", "scales[1] (v)")):
        if not hasattr(a, "shape") or tuple(a.shape) != shape[:3] or np.dtype(a.dtype) != work:
            got = f"{getattr(a, 'dtype', type(a).__name__)} {tuple(getattr(a, 'shape', ()))}"
            raise ValueError(f"{name} must be {work.name} of shape {shape[:3]}, got {got}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    return fmt, shape, work


def _build(arrays, names, k_pool, v_pool, scales, spec, kv_dtype, backend, capability, heads_axis):
    """A :class:`KVPlan` for these arrays (k, v or q; the first decides dtype and head size)."""
    xp = namespace(list(arrays) + [k_pool, v_pool], list(names) + ["k_pool", "v_pool"])
    x = arrays[0]
    for a, name in zip(arrays, names):
        check_float(a, name, xp)
    if any(a.dtype != x.dtype for a in arrays[1:]):
        raise TypeError(f"{names[1]} has dtype {arrays[1].dtype}, {names[0]} {x.dtype}: one dtype")
    fmt, shape, work = check_pools(k_pool, v_pool, scales, dtype=x.dtype, kv_dtype=kv_dtype, x=names[0])
    if int(x.shape[-1]) != shape[3]:
        raise ValueError(f"{names[0]} has head size {int(x.shape[-1])}, the pools {shape[3]} "
                         f"(num_pages, page_size, kv_heads, head_dim) = {shape}")
    heads = int(x.shape[heads_axis])
    if capability == "append_kv" and heads != shape[2]:
        raise ValueError(f"{names[0]} has {heads} heads, the pools {shape[2]} kv heads")
    if capability == "paged_attention" and (shape[2] == 0 or heads % shape[2]):
        raise ValueError(f"q heads ({heads}) must be a multiple of the pools' kv_heads ({shape[2]})")
    if spec is not None:
        spec = resolve_spec(spec, {}, shape[3], names[0])
    module = pick_backend(list(arrays), backend, capability, kv_dtype, "kv_dtype")
    for pool, name in ((k_pool, "k_pool"), (v_pool, "v_pool")):
        if type(pool) is not type(x):
            raise TypeError(f"{name} is a {type(pool).__module__}.{type(pool).__name__}, {names[0]} a "
                            f"{type(x).__module__}.{type(x).__name__}: one array type")
    plan = KVPlan()
    plan.last_append = None
    plan.fmt, plan.dtype, plan.work, plan.shape, plan.spec, plan.module, plan.xp = (
        fmt, np.dtype(x.dtype), work, shape, spec, module, xp)
    plan.device_key, plan.convert = table_converter(module, x, xp)
    plan.dense_key = _tables.dense_key(spec, work, plan.device_key) if spec is not None else None
    return plan


def kv_plan(arrays, names, k_pool, v_pool, scales, *, spec, kv_dtype, backend, capability, heads_axis=-2):
    """The cached :class:`KVPlan` of this geometry (built, and every check it stands for made, on first use)."""
    key = None
    if type(backend) is str and _keyable(arrays) and _keyable((k_pool, v_pool)):
        key = (capability, *[_part(a) for a in arrays], _part(k_pool), _part(v_pool),
               None if scales is None else tuple(_part(a) for a in scales) if _keyable(scales) else id(scales),
               id(spec), kv_dtype if isinstance(kv_dtype, (str, type(None))) else id(kv_dtype), backend, heads_axis)
        plan = _plans.get(key)
        if plan is not None and plan.module is _backends.loaded(plan.module.NAME):
            return plan
    plan = _build(arrays, names, k_pool, v_pool, scales, spec, kv_dtype, backend, capability, heads_axis)
    if key is not None:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan
    return plan


def check_memory(arrays, names, k_pool, v_pool, scales, region=None):
    """What can change under one geometry: the pools are writable and share no memory with each other, and the
    inputs (k and v) share none with the pools or scales (a write into the pools would change what is read).
    ``region``: one host array spanning every pool and scale (a cache allocates them so), tested first: an input
    apart from it is apart from each of them."""
    if region is not None:   # the cache's own pools: one buffer, writable unless a caller flipped the flag
        if k_pool.flags.writeable and v_pool.flags.writeable and (scales is None or (
                scales[0].flags.writeable and scales[1].flags.writeable)):
            for a in arrays:
                if _may_share(a, region):
                    break
            else:
                return
    stores = [(k_pool, "k_pool"), (v_pool, "v_pool")]
    if scales is not None:
        stores += [(scales[0], "scales[0]"), (scales[1], "scales[1]")]
    for a, name in stores:
        if _is_host(a) and not a.flags.writeable:
            raise ValueError(f"{name} is read-only")
    host = _is_host(k_pool)   # (then every array is: one array type) NumPy's bounds test first, the exact one after
    if (not host or _may_share(k_pool, v_pool)) and overlaps(k_pool, v_pool):
        raise ValueError("k_pool and v_pool share memory: pass two separate pools")
    for a, name in zip(arrays, names):
        for pool, pname in stores:
            if (not host or _may_share(a, pool)) and overlaps(a, pool):
                raise ValueError(f"{name} shares memory with {pname}: the append would overwrite what it reads "
                                 f"(copy {name} first)")


def flat_stores(k_pool, v_pool, scales):
    """(k entries, v entries, k scales, v scales) as the backends take them: the pools' flat slot views."""
    p, ps, hk, d = k_pool.shape
    flat = [k_pool.reshape(p * ps, hk, d), v_pool.reshape(p * ps, hk, d), None, None]
    if scales is not None:
        flat[2], flat[3] = scales[0].reshape(p * ps, hk), scales[1].reshape(p * ps, hk)
    return tuple(flat)


# -- kv_append ---------------------------------------------------------------------------------------------------
def check_slots(slots, n_tokens, total) -> np.ndarray:
    """Host ``slots`` as int64 (n_tokens,): each -1 (padding) or a distinct slot of the ``total`` in the pools."""
    s = slots if type(slots) is np.ndarray and slots.dtype == np.int64 else host_int_array(slots, "slots")
    if s.shape != (n_tokens,):
        raise ValueError(f"slots must have shape ({n_tokens},) (one per token of k), got {s.shape}")
    if not n_tokens:
        return s
    if n_tokens <= 64:   # decode-sized: cheaper in Python than NumPy's reductions and sort
        values = s.tolist()
        lo, hi = min(values), max(values)
        used = values if lo >= 0 else [x for x in values if x >= 0]
        repeated = len(set(used)) != len(used)
    else:
        lo, hi = int(s.min()), int(s.max())
        used = np.sort(s[s >= 0])
        repeated = bool(np.any(used[1:] == used[:-1]))
    if lo < -1 or hi >= total:
        i = int(np.argmax((s < -1) | (s >= total)))
        raise ValueError(f"slots[{i}] = {int(s[i])} is outside the pools' {total} slots (num_pages * page_size; "
                         "-1 marks a padding token)")
    if repeated:
        raise ValueError("slots must not repeat a slot (two tokens written to one place)")
    return s if s.flags.c_contiguous else np.ascontiguousarray(s)


def kv_append(k, v, k_pool, v_pool, slots, positions, *, spec, scales=None, kv_dtype=None, backend="auto",
              k_norm=None, norm_eps=None):
    """Rotate keys ``k`` at ``positions`` and write them with values ``v`` into ``slots`` of caller-owned pools.

    ``k_pool[slot] = Q(R(positions[t]) N(k[t]))`` and ``v_pool[slot] = Q(v[t])`` for every token t, through the
    flat ``(num_pages * page_size, kv_heads, head_dim)`` view of the pools (vLLM's ``slot_mapping``); Q rounds to
    the pools' dtype, or quantizes per (token, head) for ``kv_dtype`` "int8" / "float8_e4m3" with its scale in
    ``scales``. In place: the pools (and scales) are written, nothing is returned.

    Parameters
    ----------
    k, v : arrays (tokens, kv_heads, head_dim), one float dtype (any strides)
    k_pool, v_pool : arrays (num_pages, page_size, kv_heads, head_dim), C-contiguous, of k's array type: k's dtype,
        or the format's entries (int8; uint8 bits of float8_e4m3fn)
    slots : integer array (tokens,)
        Where each token goes (``page * page_size + offset``); -1 skips a padding token. Host (NumPy) slots are
        checked (in the pools, distinct); device slots are the caller's to keep in range.
    positions : integer array (tokens,), or (tokens, n_axes) for a multi-axis spec
        Each key's position (its rotation).
    spec : RopeSpec
        The rotation (any spec; a length-dependent one, dynamic NTK or LongRoPE, takes its length from the
        largest position of the call).
    scales : (k_scales, v_scales), each (num_pages, page_size, kv_heads) float32 (float64 for float64 k)
        With a quantized ``kv_dtype`` only.
    kv_dtype : None, "int8" or "float8_e4m3"
        The pools' entry format (:data:`rotary.backends.kv_entries.KV_FORMATS`).
    backend : "auto", "numpy", "numba" or "cupy"
        A named backend without this format raises NotImplementedError; "auto" falls back to NumPy.
    k_norm : array (head_dim,), optional
        Per-head RMSNorm weights applied to each key head before its rotation (Qwen3's / Gemma 3's ``k_norm``; for
        Gemma pass ``1 + weight``): ``N(x)_j = (x_j * inv) * k_norm_j``, ``inv = 1 / sqrt(mean(x^2) + norm_eps)``
        in the work dtype. None (default): N is the identity.
    norm_eps : float >= 0, optional
        The norm's eps (default 1e-6, :data:`NORM_EPS`); only with ``k_norm``.
    """
    plan, run = append_setup(k, v, k_pool, v_pool, slots, positions, spec=spec, scales=scales, kv_dtype=kv_dtype,
                             backend=backend)
    norm = plan.norm(k_norm, norm_eps, "k_norm")
    check_memory((k, v) if norm is None else (k, v, norm[0]), ("k", "v", "k_norm"), k_pool, v_pool, scales)
    run(k, v, flat_stores(k_pool, v_pool, scales), norm)


def append_setup(k, v, k_pool, v_pool, slots, positions, *, spec, scales, kv_dtype, backend, keep=False):
    """(plan, run) of a :func:`kv_append` call: every check but the memory rule and the norm's, and the backend's
    prepared append (``run(k, v, stores, norm)``). ``keep``: host slots and positions copied (a prepared append
    outlives the caller's arrays)."""
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
    _check_entries_arrays(k, v)
    plan = kv_plan((k, v), ("k", "v"), k_pool, v_pool, scales, spec=spec, kv_dtype=kv_dtype, backend=backend,
                   capability="append_kv")
    n = int(k.shape[0])
    if _is_host(slots) or isinstance(slots, (list, tuple)) or plan.convert is None:
        slots = check_slots(slots, n, plan.slots_total)
        slots = slots.copy() if keep else slots
    elif tuple(slots.shape) != (n,) or np.dtype(slots.dtype).kind not in "iu":
        raise ValueError(f"slots must be an integer array of shape ({n},), got {slots.dtype} {tuple(slots.shape)}")
    pos, token_positions = token_rotation_positions(plan.spec, positions, n)
    if keep and pos is positions:
        pos = pos.copy()
    return plan, plan.prepare_append(k, v, slots, plan.rotation(pos, token_positions))


def _check_entries_arrays(k, v):
    for a, name in ((k, "k"), (v, "v")):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array (tokens, kv_heads, head_dim), got {type(a).__name__}")
        if a.ndim != 3:
            raise ValueError(f"{name} must be 3-D (tokens, kv_heads, head_dim), got shape {tuple(a.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")


def token_rotation_positions(spec, positions, n_tokens, name="positions"):
    """(host positions, token_positions): 1-D int64 positions of the tokens (``token_positions`` True) for a 1-D
    spec, else the normalized (1, T[, n_axes]) rotation positions."""
    if positions is None:
        raise TypeError(f"{name} is required (each token's position)")
    if not spec.multi_axis and not spec.float_positions:
        p = positions if type(positions) is np.ndarray and positions.dtype == np.int64 else \
            host_int_array(positions, name)
        if p.shape != (n_tokens,):
            raise ValueError(f"{name} must have shape ({n_tokens},) (one per token), got {p.shape}")
        return (p if p.flags.c_contiguous else np.ascontiguousarray(p)), True
    return normalize_positions(positions, (), n_tokens, name, spec=spec), False


# -- paged_attention ---------------------------------------------------------------------------------------------
def attention_options(causal, window, softcap, scale, spec, head_dim, dtype=None):
    """(causal, window, softcap, scale) checked: the default scale head_dim**-0.5 (times the spec's
    softmax_scale_factor when a spec is given); a softcap the float32 work dtype of ``dtype`` inputs cannot hold
    is refused (:func:`rotary.attn.softmax.check_float32_softcap`)."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = optional_number(window, "window", integer=True)
    softcap = optional_number(softcap, "softcap")
    if window is not None and not causal:
        raise ValueError("window (a sliding window) needs causal=True")
    if scale is None:
        scale = getattr(spec, "softmax_scale_factor", 1.0) / math.sqrt(head_dim) if head_dim else 1.0
    else:
        scale = optional_number(scale, "scale")
    if softcap is not None and dtype is not None and np.dtype(dtype) != np.float64:
        from ..attn.softmax import check_float32_softcap

        check_float32_softcap(softcap, scale, dtype)
    return bool(causal), window, softcap, scale


def packed_queries(q, cu_seqlens, layout="bshd"):
    """(packed q (T, Hq, D), counts (n,), dense shape or None): q (n, s, Hq, D) (``layout`` "bhsd": (n, Hq, s, D))
    or packed (T, Hq, D) with ``cu_seqlens``."""
    if not hasattr(q, "shape") or not hasattr(q, "dtype"):
        raise TypeError(f"q must be an array, got {type(q).__name__}")
    if cu_seqlens is None:
        if q.ndim != 4:
            raise ValueError(f"q must be 4-D ({layout}: (n, s, heads, head_dim)), or packed (tokens, heads, head_dim) "
                             f"with cu_seqlens; got shape {tuple(q.shape)}" if layout == "bshd" else
                             f"q must be 4-D (bhsd: (n, heads, s, head_dim)), got shape {tuple(q.shape)}")
        qd = q if layout == "bshd" else q.transpose(0, 2, 1, 3)
        n, s = int(qd.shape[0]), int(qd.shape[1])
        return qd.reshape(n * s, int(qd.shape[2]), int(qd.shape[3])), np.full(n, s, np.int64), tuple(qd.shape)
    if q.ndim != 3:
        raise ValueError(f"packed q (with cu_seqlens) must be (tokens, q_heads, head_dim), got {tuple(q.shape)}")
    return q, np.diff(check_cu_seqlens(cu_seqlens, int(q.shape[0]), "cu_seqlens")), None


def query_positions(spec, q_positions, seq_lens, counts, dense_shape):
    """Rotation positions of the queries: ``q_positions`` as given (dense (n, s[, n_axes]) or packed
    (T[, n_axes])), else each sequence's last positions ``seq_lens[i] - c_i ..``; (positions, token_positions)
    as :func:`token_rotation_positions`."""
    if q_positions is None and dense_shape is not None:   # s queries per sequence
        if spec.multi_axis and spec.mrope_section is None:
            raise ValueError("this multi-axis spec needs q_positions= (each query's coordinates)")
        s = dense_shape[1]
        pos = seq_lens - 1 if s == 1 else (seq_lens[:, None] + np.arange(-s, 0, dtype=np.int64)).reshape(-1)
        if not spec.multi_axis:
            return pos, True
        return normalize_positions(pos, (), pos.size, "q_positions", spec=spec), False
    n_tokens = int(counts.sum())
    if q_positions is None:
        if spec.multi_axis and spec.mrope_section is None:
            raise ValueError("this multi-axis spec needs q_positions= (each query's coordinates)")
        starts = np.cumsum(counts) - counts
        pos = np.arange(n_tokens, dtype=np.int64) + np.repeat(seq_lens - counts - starts, counts)
        if not spec.multi_axis:
            return pos, True
        return normalize_positions(pos, (), n_tokens, "q_positions", spec=spec), False
    if dense_shape is not None:
        p = np.asarray(q_positions) if isinstance(q_positions, (list, tuple)) else q_positions
        n, s = dense_shape[:2]
        if not hasattr(p, "shape") or tuple(p.shape[:2]) != (n, s):
            raise ValueError(f"q_positions must have shape ({n}, {s}{', n_axes' if spec.multi_axis else ''}) (one per "
                             f"query), got {getattr(p, 'shape', type(p).__name__)}")
        q_positions = p.reshape((n * s,) + tuple(p.shape[2:]))
    return token_rotation_positions(spec, q_positions, n_tokens, "q_positions")


def check_query_counts(counts, lens, ids=None):
    """Every sequence holds its queries (the last tokens of it): ``counts <= lens``."""
    short = np.flatnonzero(counts > lens)
    if short.size:
        i = int(short[0])
        which = f"sequence {i}" if ids is None else f"sequence {int(ids[i])}"
        raise ValueError(f"q has {int(counts[i])} tokens for {which}, which holds {int(lens[i])}: the queries are the "
                         "last tokens of their sequence (append their keys and values first)")


def check_tables(block_table, seq_lens, counts, page_size, num_pages, window=None):
    """Host block_table (n, W) and seq_lens (n,) as int64, checked: every sequence holds its queries
    (c_i <= seq_lens[i]) within its W pages, every page it reads in the pool (with a causal ``window``, pages
    wholly before the first query's window are not read: an engine may have given them back, -1)."""
    n = counts.size
    lens = host_int_array(seq_lens, "seq_lens")
    table = host_int_array(block_table, "block_table")
    if lens.shape != (n,):
        raise ValueError(f"seq_lens must have shape ({n},) (one per sequence of q), got {lens.shape}")
    if table.ndim != 2 or table.shape[0] != n:
        raise ValueError(f"block_table must be 2-D (sequences, pages per sequence) with {n} rows, got {table.shape}")
    check_query_counts(counts, lens)
    if n and int(lens.max()) > table.shape[1] * page_size:
        i = int(np.argmax(lens))
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} needs more than the block table's {table.shape[1]} pages of "
                         f"{page_size}")
    cols = np.arange(table.shape[1])[None, :]
    used = cols < -(-lens[:, None] // page_size)
    if window is not None:
        used &= cols >= (np.clip(lens - counts - window + 1, 0, None) // page_size)[:, None]
    pages = table[used]
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))[0]
        raise ValueError(f"block_table[{bad[0]}, {bad[1]}] = {int(table[bad[0], bad[1]])} is not a page of the pool "
                         f"({num_pages} pages) but sequence {bad[0]} reads it")
    return table, lens


def paged_attention(q, k_pool, v_pool, block_table, seq_lens, *, spec=None, cu_seqlens=None, q_positions=None,
                    causal=True, window=None, softcap=None, scale=None, scales=None, kv_dtype=None, backend="auto",
                    q_norm=None, norm_eps=None):
    """Softmax attention of the newest queries of n sequences over their keys in caller-owned pages (see the
    module docstring for the formula): pages are read where they lie, dense decode and packed mixed
    (prefill chunks + decode tokens) steps alike.

    Parameters
    ----------
    q : array (n, s, q_heads, head_dim), or packed (tokens, q_heads, head_dim) with ``cu_seqlens``
        The last s (c_i) tokens of each sequence, their keys already appended. q_heads a multiple of kv_heads.
    k_pool, v_pool : arrays (num_pages, page_size, kv_heads, head_dim), as :func:`kv_append` writes them
    block_table : integer array (n, pages per sequence)
        Sequence i's page j holds its keys ``j * page_size ..``; several sequences may name one page.
    seq_lens : integer array (n,)
        Keys held per sequence (the queries' own included).
    spec : RopeSpec, optional
        Rotate q at its positions (``q_positions``, default each sequence's last positions); None: q is rotated.
    cu_seqlens : integer array (n + 1,), optional
        Packed q's offsets (flash-attn's convention).
    causal, window, softcap, scale
        As :func:`rotary.attention` (the default scale ``head_dim**-0.5``, times the spec's
        ``softmax_scale_factor`` where it has one).
    scales, kv_dtype, backend
        As :func:`kv_append`.
    q_norm, norm_eps : optional
        Per-head RMSNorm weights of q applied before its rotation (Qwen3's / Gemma 3's ``q_norm``), as
        :func:`kv_append`'s ``k_norm``; in the kernel, as q is read.

    Returns an array shaped as q, q's type and dtype.
    """
    qp, counts, dense_shape = packed_queries(q, cu_seqlens)
    plan, run = attention_setup(qp, counts, dense_shape, k_pool, v_pool, block_table, seq_lens, spec=spec,
                                q_positions=q_positions, causal=causal, window=window, softcap=softcap, scale=scale,
                                scales=scales, kv_dtype=kv_dtype, backend=backend)
    norm = plan.norm(q_norm, norm_eps, "q_norm")
    o = run(contiguous(qp), flat_stores(k_pool, v_pool, scales), norm)
    return o if dense_shape is None else o.reshape(q.shape)


def attention_setup(qp, counts, dense_shape, k_pool, v_pool, block_table, seq_lens, *, spec, q_positions, causal,
                    window, softcap, scale, scales, kv_dtype, backend, keep=False):
    """(plan, run) of a :func:`paged_attention` call of packed ``qp`` (:func:`packed_queries`): every check but the
    norm's, and the backend's prepared attention (``run(C-contiguous qp, stores, norm) -> o``). ``keep``: host
    tables copied (a prepared attention outlives the caller's arrays)."""
    attention_options(causal, window, softcap, scale, None, 0)   # the options' errors before the backend's
    if spec is None and q_positions is not None:
        raise ValueError("q_positions goes with spec= (the queries' rotation); without a spec q is taken as rotated")
    plan = kv_plan((qp,), ("q",), k_pool, v_pool, scales, spec=spec, kv_dtype=kv_dtype, backend=backend,
                   capability="paged_attention")
    causal, window, softcap, scale = attention_options(causal, window, softcap, scale, plan.spec, plan.shape[3],
                                                       plan.dtype)
    num_pages, page_size = plan.shape[:2]
    host = _is_host(block_table) or isinstance(block_table, (list, tuple)) or plan.convert is None
    if host:
        table, lens = check_tables(block_table, seq_lens, counts, page_size, num_pages,
                                   window if causal else None)
        if keep:
            table, lens = table.copy(), lens.copy()
    else:
        table, lens = block_table, seq_lens
        if table.ndim != 2 or table.shape[0] != counts.size or tuple(lens.shape) != (counts.size,):
            raise ValueError(f"block_table must be (n, pages) and seq_lens (n,) with n = {counts.size}, got "
                             f"{tuple(table.shape)} and {tuple(lens.shape)}")
    q_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rotation = query_rotation(plan, q_positions, lens, counts, dense_shape)
    if keep and rotation is not None and q_positions is not None and _is_host(rotation[2]) \
            and np.may_share_memory(rotation[2], q_positions):
        rotation = rotation[:2] + (rotation[2].copy(),) + rotation[3:]
    return plan, plan.prepare_attention(contiguous(qp), table, page_size, lens, q_starts, scale=scale,
                                        softcap=softcap, window=window, causal=causal, rotation=rotation)


def contiguous(q):
    """q itself when C-contiguous, else a C-contiguous copy (the backends' paged_attention takes such q)."""
    return q if q.flags.c_contiguous else q.copy(order="C")


def query_rotation(plan, q_positions, lens, counts, dense_shape, lens_range=None):
    """The rotation of packed q at its positions (``q_positions``, or each sequence's last positions) by the plan's
    spec, as the backends' paged_attention takes it (q rotated in the kernel); None without a spec.
    ``lens_range``: (min, max) of host ``lens`` when the caller knows it."""
    if plan.spec is None:
        return None
    host_lens = lens if _is_host(lens) else np.asarray(lens.get(), np.int64)
    pos, token_positions = query_positions(plan.spec, q_positions, host_lens, counts, dense_shape)
    bounds = None
    if lens_range is not None and q_positions is None and dense_shape is not None:
        bounds = (lens_range[0] - dense_shape[1], lens_range[1] - 1)
    return plan.rotation(pos, token_positions, bounds)


def dense_starts(n, s):
    """q_starts of n sequences of s queries each: ``0, s, 2 s, ..``."""
    return np.arange(0, n * s + 1, s, dtype=np.int64) if s else np.zeros(n + 1, np.int64)


__all__ = ["KVPlan", "kv_append", "kv_plan", "paged_attention"]

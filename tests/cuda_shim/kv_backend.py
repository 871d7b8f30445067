"""A backend module over the host shim: the CuPy backend's plans launched on NumPy arrays (test harness).

``shim_backend(kernels)`` is the rotation and linear-attention backend (its backward too:
:func:`run_linear_attention_backward`, the CuPy glue's checks and plans on NumPy arrays); ``kv_shim_backend(kernels)`` adds the KV
primitives with the contract's signatures (:mod:`rotary.backends`), taking host NumPy arrays for every table:

    append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype, norm=None)
    paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal,
                    kv_dtype, rotation=None, norm=None) -> o

(``norm`` = (weight, eps) as the contract has it: weight a NumPy array here, passed to the plan as it is)

and ``VARIANTS`` (the CuPy backend's). ``register(monkeypatch)`` builds the shim (once per process; pytest.skip
without a host C++ compiler) and installs ``kv_shim_backend`` in the registry as "cuda-shim" until the test ends,
so the public functions take ``backend="cuda-shim"``::

    @pytest.fixture
    def cuda_shim(monkeypatch):
        return kv_backend.register(monkeypatch)          # the module; its NAME is "cuda-shim"

``register(monkeypatch, module)`` installs a module of one's own (e.g. ``shim_backend(kernels, threads=32)``);
without a monkeypatch, ``module.unregister()`` undoes it. ``shared_kernels()`` is the per-process build.
"""

from __future__ import annotations

import os
import tempfile
import types
from pathlib import Path

import numpy as np

from rotary import backends as registry
from rotary.backends import cupy as cb

from . import host

#: the registry name the shim backend is installed under
NAME = "cuda-shim"
_built: dict = {}


def shared_kernels(directory: str | Path | None = None) -> host.HostKernels:
    """The shim library of every kernel instantiation, built once per process (and per directory) into
    ``directory`` (default: a fixed one under the temp dir, reused across runs while the sources are unchanged).
    Calls pytest.skip when there is no host C++ compiler."""
    if host.compiler() is None:
        import pytest

        pytest.skip("no host C++ compiler (g++/clang++) to build the CUDA sources with the shim")
    directory = Path(directory or Path(tempfile.gettempdir()) / f"rotary-cuda-shim-{os.getuid()}")
    if directory not in _built:
        _built[directory] = host.build(directory)
    return _built[directory]


def dtype_name(a) -> str:
    return str(a.dtype)


def work_of(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def shim_backend(kernels, threads=256, max_tokens_per_block=None, shared_mem_limit=cb.SHARED_MEM_LIMIT):
    """A backend module for NumPy arrays that runs the CUDA rotation and linear-attention kernels (forward and
    backward) on the CPU (the same plans as CuPy)."""

    def rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse, out_layout=None):
        outs = [np.empty(x.shape, x.dtype) if out is None else out for x, out in items]
        work = np.float64 if items[0][0].dtype == np.float64 else np.float32
        cos, sin = np.ascontiguousarray(cos, work), np.ascontiguousarray(sin, work)
        rows = np.ascontiguousarray(rows, np.int64)
        pairs = [(x, y) for (x, _), y in zip(items, outs)]
        for i in range(0, len(pairs), 2):
            group = pairs[i:i + 2]
            if len(group) == 2 and group[0][0].dtype != group[1][0].dtype:
                group = group[:1]
            kernels.launch(cb.plan_rotate(group, cos, sin, rows, dtype_name=dtype_name(group[0][0]),
                                          rotary_dim=rotary_dim, layout=layout, inverse=inverse,
                                          address=host.address, threads=threads,
                                          max_tokens_per_block=max_tokens_per_block, out_layout=out_layout))
            if len(group) == 1 and i + 1 < len(pairs):
                x, y = pairs[i + 1]
                kernels.launch(cb.plan_rotate([(x, y)], cos, sin, rows, dtype_name=dtype_name(x),
                                              rotary_dim=rotary_dim, layout=layout, inverse=inverse,
                                              address=host.address, threads=threads,
                                              max_tokens_per_block=max_tokens_per_block, out_layout=out_layout))
        return outs

    def linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                         decay=None, normalize=True, cu_seqlens=None):
        return run_linear_attention(kernels, q, k, v, cos, sin, rows, rotary_dim=rotary_dim, layout=layout,
                                    causal=causal, feature_map=feature_map, eps=eps, chunk=chunk, state=state,
                                    threads=threads, shared_mem_limit=shared_mem_limit, decay=decay,
                                    normalize=normalize, cu_seqlens=cu_seqlens)

    def linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps,
                                  chunk, state, decay=None, normalize=True, grad_state=None):
        return run_linear_attention_backward(kernels, q, k, v, cos, sin, rows, grad_o, rotary_dim=rotary_dim,
                                             layout=layout, causal=causal, feature_map=feature_map, eps=eps,
                                             chunk=chunk, state=state, decay=decay, normalize=normalize,
                                             grad_state=grad_state, threads=threads, shared_mem_limit=shared_mem_limit)

    return types.SimpleNamespace(NAME=NAME, availability=lambda: (True, "ok"),
                                 accepts=lambda x: isinstance(x, np.ndarray), rotate=rotate,
                                 linear_attention=linear_attention, PACKED_LINEAR_ATTENTION=True,
                                 linear_attention_backward=linear_attention_backward)


def run_linear_attention_backward(kernels, q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal,
                                  feature_map, eps, chunk, state, decay=None, normalize=True, grad_state=None,
                                  threads=cb.LINEAR_BACKWARD_THREADS, shared_mem_limit=cb.SHARED_MEM_LIMIT,
                                  plans=None, poison=np.nan):
    """The CuPy backend's ``linear_attention_backward`` glue on NumPy arrays: the same checks
    (:func:`rotary.backends.cupy.check_linear_backward`) and plans (``plans``: a list that receives them), the
    scratch buffers filled with ``poison`` (the kernels must write every value they read)."""
    cb.check_linear_backward(q, k, v, grad_o, feature_map=feature_map, causal=causal, decay=decay)
    if grad_o.dtype != q.dtype:
        grad_o = grad_o.astype(q.dtype)
    work = work_of(q.dtype)
    B, T, H, m = q.shape
    Hk, dvd = k.shape[2], v.shape[3]

    def work_array(x, shape):
        return np.zeros(shape, work) if x is None else np.ascontiguousarray(np.asarray(x).reshape(shape), work)

    S0, z0 = (None, None) if state is None else state
    gS, gz = (None, None) if grad_state is None else grad_state
    s_shape, z_shape = (B, Hk, m, dvd), (B, Hk, m)
    S0, z0, gS, gz = work_array(S0, s_shape), work_array(z0, z_shape), work_array(gS, s_shape), work_array(gz, z_shape)
    d_s, d_z = np.full(s_shape, np.nan, work), np.full(z_shape, np.nan, work)
    empty_plan = B * Hk * T * m == 0
    dq, dk, dv = ((np.zeros if empty_plan else np.empty)(x.shape, x.dtype) for x in (q, k, v))
    launches = cb.plan_linear_attention_backward(
        q, k, v, grad_o, dq, dk, dv, S0, z0, gS, gz, d_s, d_z, np.ascontiguousarray(cos, work),
        np.ascontiguousarray(sin, work), np.ascontiguousarray(rows, np.int64), lambda n: np.full(n, poison, work),
        dtype_name=str(q.dtype), rotary_dim=rotary_dim, layout=layout, causal=causal, feature_map=feature_map,
        eps=eps, chunk=chunk, threads=threads, shared_mem_limit=shared_mem_limit,
        powers=cb.powers_table(decay, max(1, int(chunk)), work), normalize=normalize)
    if plans is not None:
        plans.extend(launches)
    for launch in launches:
        kernels.launch(launch)
    if not launches:
        d_s, d_z = gS, gz
    return dq, dk, dv, (None if state is None else (d_s, d_z))


def run_linear_attention(kernels, q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk,
                         state, threads=256, shared_mem_limit=cb.SHARED_MEM_LIMIT, dtype_name=None, decay=None,
                         normalize=True, cu_seqlens=None):
    dtype_name = dtype_name or str(q.dtype)
    work = np.float64 if cb.KERNEL_TYPES[dtype_name][1] == "double" else np.float32
    n_batch, seq_len, n_heads_q, m = q.shape
    n_heads, dv = k.shape[2], v.shape[3]
    o = np.empty((n_batch, seq_len, n_heads_q, dv), q.dtype)
    if cu_seqlens is not None:   # a packed batch: the states' batch is the number of sequences
        cu_seqlens = np.ascontiguousarray(cu_seqlens, np.int64)
        n_batch = cu_seqlens.shape[0] - 1
    if state is None:
        s_state, z_in = np.zeros((n_batch, n_heads, m, dv), work), np.zeros((n_batch, n_heads, m), work)
    else:
        s_state = np.array(state[0], work, order="C")
        z_in = np.zeros((n_batch, n_heads, m), work) if state[1] is None else np.ascontiguousarray(state[1], work)
    z_state = np.full((n_batch, n_heads, m), np.nan, work)
    plan = cb.plan_linear_attention(q, k, v, o, s_state, z_in, z_state, np.ascontiguousarray(cos, work),
                                    np.ascontiguousarray(sin, work), np.ascontiguousarray(rows, np.int64),
                                    dtype_name=dtype_name, rotary_dim=rotary_dim, layout=layout, causal=causal,
                                    feature_map=feature_map, eps=eps, chunk=chunk, threads=threads,
                                    shared_mem_limit=shared_mem_limit, normalize=normalize,
                                    powers=cb.powers_table(decay, max(1, int(chunk)), work), cu_seqlens=cu_seqlens)
    kernels.launch(plan)
    return o, (s_state, z_state)


def _kernel_dtype(a) -> str:
    """The kernels' dtype name of a NumPy array: ml_dtypes' bfloat16 and raw uint16 bits are "bfloat16"."""
    name = str(a.dtype)
    return "bfloat16" if name == "uint16" else name


def kv_shim_backend(kernels, *, append=None, attention=None, **rotation):
    """:func:`shim_backend` plus the KV primitives ``append_kv`` and ``paged_attention`` on the kv_append and
    paged_attention kernels (NumPy arrays; tables as host NumPy arrays, any integer dtype), with ``VARIANTS``.
    ``append``: kv_append plan options (threads, group, max_tokens_per_block); ``attention``: paged_attention plan
    options (threads, tile, splits). ``calls`` lists each KV call's kernel (append) or kernels (attention: a tuple,
    with the split-K combine when the plan splits); None: nothing to launch."""
    module = shim_backend(kernels, **rotation)
    append, attention = dict(append or {}), dict(attention or {})
    calls = []

    def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype, norm=None):
        work = work_of(k.dtype)
        cos, sin = np.ascontiguousarray(cos, work), np.ascontiguousarray(sin, work)
        plan = cb.plan_append_kv(k, v, cos, sin, np.ascontiguousarray(rows, np.int64).reshape(-1),
                                 np.ascontiguousarray(slots, np.int64).reshape(-1), stores, dtype_name=_kernel_dtype(k),
                                 rotary_dim=rotary_dim, layout=layout, offset=offset, kv_dtype=kv_dtype, norm=norm,
                                 **append)
        kernels.launch(plan)
        calls.append(None if plan is None else plan.kernel)

    def paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal,
                        kv_dtype, rotation=None, norm=None):
        o = np.empty(q.shape, q.dtype)
        if rotation is not None:
            cos, sin, rows, rotary_dim, layout, offset = rotation
            work = work_of(q.dtype)
            rotation = (np.ascontiguousarray(cos, work), np.ascontiguousarray(sin, work),
                        np.ascontiguousarray(rows, np.int64).reshape(-1), rotary_dim, layout, offset)
        plan = cb.plan_paged_attention(q, o, stores, np.ascontiguousarray(block_table, np.int64), page_size,
                                       np.ascontiguousarray(seq_lens, np.int64),
                                       np.ascontiguousarray(q_starts, np.int64), dtype_name=_kernel_dtype(q),
                                       scale=scale, softcap=softcap, window=window, causal=causal, kv_dtype=kv_dtype,
                                       rotation=rotation, norm=norm, **attention)
        for launch in () if plan is None else plan.launches:
            kernels.launch(launch)
        calls.append(None if plan is None else tuple(launch.kernel for launch in plan.launches))
        return o

    return types.SimpleNamespace(**vars(module), append_kv=append_kv, paged_attention=paged_attention,
                                 VARIANTS=dict(cb.VARIANTS), calls=calls)


def register(monkeypatch=None, module=None, **options):
    """Install ``module`` (None: ``kv_shim_backend(shared_kernels(), **options)``) in the backend registry as
    "cuda-shim" and return it. With a pytest ``monkeypatch`` the registry is restored when the test ends; without
    one, call ``module.unregister()``."""
    if module is None:
        module = kv_shim_backend(shared_kernels(), **options)
    if monkeypatch is not None:
        monkeypatch.setitem(registry._MODULES, NAME, "tests.cuda_shim")
        monkeypatch.setitem(registry._loaded, NAME, module)
        return module
    tables = (registry._MODULES, registry._loaded)
    saved = [table.get(NAME, _MISSING) for table in tables]
    registry._MODULES[NAME] = "tests.cuda_shim"
    registry._loaded[NAME] = module

    def unregister():
        for table, value in zip(tables, saved):
            if value is _MISSING:
                table.pop(NAME, None)
            else:
                table[NAME] = value

    module.unregister = unregister
    return module


_MISSING = object()

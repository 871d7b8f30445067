"""Conformance cases of :class:`rotary.KVCache`: appends and attention over the cache against float64 oracles.

Each :class:`KVCase` fills a cache of 3 sequences on a backend (a packed ragged prefill of 5, 1 and 8 tokens,
then ``steps`` dense decode appends of one token each) and checks:

- every sequence's keys (``cache.keys(b)``, dequantized) against :func:`rotary.testing.rope_complex` of the
  appended keys at positions 0.. with the spec's frequencies and attention scaling, and its values;
- ``attention(q, cache)`` of the last ``q_len`` tokens of each sequence against
  :func:`rotary.testing.attention_quadratic` on the same (quantized: dequantized) keys and values.

A case with ``qk_norm`` normalizes each k and q head before RoPE (Qwen3's / Gemma 3's q_norm and k_norm, fused
into the append and the attention: ``append(k_norm=)``, ``attend(q_norm=)``, ``kv_append(k_norm=)``,
``paged_attention(q_norm=)``); the oracles norm the appended keys and q in float64 first.

A case with ``caller_tables`` runs the same tokens through the stateless primitives instead, over pools and a
block table the case owns (as an engine does): :func:`rotary.kv_append` with vLLM's slot mapping (a padding
token of slot -1 in the prefill; each decode step's append prepared once, :func:`rotary.prepare_kv_append`) and
:func:`rotary.paged_attention` with packed queries (whose bits :func:`rotary.prepare_paged_attention`'s run must
give too); sequences 0 and 2 read one shared page holding the same first tokens. A backend that does not offer a case's format is reported as
skipped.

Float caches use the rotation tolerances of :data:`rotary.testing.TOLERANCES`; quantized caches a bound on
``max |error| / max |reference|`` per sequence: int8 rounds to half a step of amax/127 (0.4 %), float8_e4m3
to 2^-4 relative (6.25 %), with margin.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..spec.rope_spec import RopeSpec
from ..testing import attention_quadratic, rope_complex, tolerance
from .cases import SCALINGS, Result, array_converters

#: max |error| / max |reference| of quantized entries (half a step plus the rotation's rounding)
KV_ENTRY_TOLERANCES = {"int8": 0.5 / 127 * 1.01 + 1e-6, "float8_e4m3": 2.0 ** -4 * 1.01}
#: max |o - o_ref| / max |o_ref| of attention over a quantized cache against the oracle on its dequantized entries
KV_ATTENTION_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class KVCase:
    name: str
    paged: bool = False
    dtype: str = "float32"
    kv_dtype: str | None = None
    layout: str = "half"
    rotary_dim: int | None = None
    scaling: str | None = None
    q_len: int = 1
    window: int | None = None
    softcap: float | None = None
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    steps: int = 2
    caller_tables: bool = False
    qk_norm: bool = False

    def spec(self) -> RopeSpec:
        scaling = SCALINGS[self.scaling] if self.scaling else None
        return RopeSpec(self.head_dim, rotary_dim=self.rotary_dim, layout=self.layout, scaling=scaling,
                        max_position_embeddings=64 if scaling else None)


def kv_cases(quick: bool = False) -> list[KVCase]:
    every = [
        KVCase("kv-contiguous-f32"),
        KVCase("kv-paged-f32", paged=True),
        KVCase("kv-paged-f64-interleaved", paged=True, dtype="float64", layout="interleaved"),
        KVCase("kv-f16-partial", dtype="float16", rotary_dim=8),
        KVCase("kv-yarn-chunk", scaling="yarn", q_len=3, paged=True),
        KVCase("kv-llama3-window-softcap", scaling="llama3", window=4, softcap=20.0),
        KVCase("kv-int8-paged", kv_dtype="int8", paged=True),
        KVCase("kv-int8-f64", kv_dtype="int8", dtype="float64", layout="interleaved"),
        KVCase("kv-float8", kv_dtype="float8_e4m3", paged=True),
        KVCase("kv-mqa-d64", heads=8, kv_heads=1, head_dim=64, q_len=2),
        KVCase("kv-primitives-f32", caller_tables=True, q_len=2),
        KVCase("kv-primitives-int8-window", caller_tables=True, kv_dtype="int8", window=3, layout="interleaved"),
        KVCase("kv-primitives-f16-yarn", caller_tables=True, dtype="float16", scaling="yarn"),
        KVCase("kv-qk-norm-yarn", paged=True, scaling="yarn", q_len=2, qk_norm=True),
        KVCase("kv-qk-norm-window-softcap-f16", dtype="float16", window=4, softcap=20.0, qk_norm=True),
        KVCase("kv-primitives-qk-norm-int8", caller_tables=True, kv_dtype="int8", layout="interleaved",
               rotary_dim=8, qk_norm=True),
    ]
    quick_names = ("kv-paged-f32", "kv-int8-paged", "kv-primitives-f32", "kv-qk-norm-yarn")
    return [c for c in every if c.name in quick_names] if quick else every


def run(backends, quick: bool = False) -> list[Result]:
    """Every KV case on every backend of ``backends`` (names)."""
    results = []
    for name in backends:
        to_backend, to_host = array_converters(name)
        results.extend(run_kv_case(case, name, to_backend=to_backend, to_host=to_host) for case in kv_cases(quick))
    return results


def run_kv_case(case: KVCase, backend: str, *, to_backend=None, to_host=None, seed: int = 0) -> Result:
    """Fill a cache on ``backend`` (inputs moved with ``to_backend``, results back with ``to_host``) and compare
    its keys, values and attention with the float64 oracles (see the module docstring)."""
    from ..attn.softmax import attention
    from ..kvcache.store import KVCache
    from ..spec.validators import to_numpy

    to_backend = to_backend or (lambda a: a)
    to_host = to_host or (lambda a: to_numpy(a))
    if case.kv_dtype == "float8_e4m3":
        import importlib.util

        if importlib.util.find_spec("ml_dtypes") is None:
            return Result(case.name, backend, float("nan"), 0.0, True, 0.0, "skipped: ml_dtypes is not installed")
    from .. import backends as registry

    module = registry.get(backend) if backend != "auto" else None
    if module is not None and not registry.supports(module, "append_kv", case.kv_dtype, any_variant=False):
        return Result(case.name, backend, float("nan"), 0.0, True, 0.0,
                      f"skipped: backend {backend!r} does not offer kv_dtype={case.kv_dtype!r}")
    rng = np.random.default_rng(seed)
    spec = case.spec()
    dt = np.dtype(case.dtype)
    hk, d = case.kv_heads, case.head_dim
    norms = _norm_weights(case, rng)
    counts = [5, 1, 8]
    size = dict(page_size=4, num_pages=32) if case.paged else dict(capacity=16)
    t0 = time.perf_counter()
    if case.caller_tables:
        filled = _caller_tables(case, spec, dt, rng, backend, to_backend, to_host, norms)
        if isinstance(filled, Result):
            return filled
        ks, vs, q, o, held = filled
    try:
        if case.caller_tables:
            raise _Done
        cache = KVCache(spec, batch=3, kv_heads=hk, head_dim=d, dtype=dt, kv_dtype=case.kv_dtype, backend=backend,
                        **size)
        ks = [rng.standard_normal((c, hk, d)).astype(dt) for c in counts]
        vs = [rng.standard_normal((c, hk, d)).astype(dt) for c in counts]
        cu = np.concatenate([[0], np.cumsum(counts)])
        k_norm = {} if norms is None else dict(k_norm=to_backend(norms[0]), norm_eps=NORM_EPS)
        cache.append(to_backend(np.concatenate(ks)), to_backend(np.concatenate(vs)), cu_seqlens=cu, **k_norm)
        for _ in range(case.steps):
            k1 = rng.standard_normal((3, 1, hk, d)).astype(dt)
            v1 = rng.standard_normal((3, 1, hk, d)).astype(dt)
            cache.append(to_backend(k1), to_backend(v1), **k_norm)
            ks = [np.concatenate([a, k1[b, :1]]) for b, a in enumerate(ks)]
            vs = [np.concatenate([a, v1[b, :1]]) for b, a in enumerate(vs)]
        q = rng.standard_normal((3, case.q_len, case.heads, d)).astype(dt)
        if norms is None:
            o = to_host(attention(to_backend(q), cache, window=case.window, softcap=case.softcap))
        else:
            o = to_host(cache.attend(to_backend(q), window=case.window, softcap=case.softcap,
                                     q_norm=to_backend(norms[1]), norm_eps=NORM_EPS))
        held = [(to_host(cache.keys(b)).astype(np.float64), to_host(cache.values(b)).astype(np.float64))
                for b in range(3)]
    except _Done:
        pass
    except Exception as exc:  # reported as a failure, not raised, so the runner can print a table
        return Result(case.name, backend, float("nan"), 0.0, False, 0.0, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    inv = spec.inv_freq()
    rtol, atol = tolerance(case.dtype)
    worst, ok = 0.0, True
    for b, (keys, values) in enumerate(held):
        pos = np.arange(len(ks[b]))
        want = rope_complex(_norm64(ks[b], norms, 0).transpose(1, 0, 2), pos, inv, layout=spec.layout,
                            scale=spec.attention_scaling).transpose(1, 0, 2)
        for got, ref in ((keys, want), (values, vs[b].astype(np.float64))):
            if case.kv_dtype is None:
                err = np.abs(got - ref)
                worst = max(worst, float(err.max()))
                ok &= bool(np.all(err <= atol + rtol * np.abs(ref)))
            else:
                # per (token, head): the step is amax of that head's exact values / LIMIT
                err = np.abs(got - ref).max(axis=-1) / np.abs(ref).max(axis=-1)
                worst = max(worst, float(err.max()))
                ok &= bool(err.max() <= KV_ENTRY_TOLERANCES[case.kv_dtype])
        # attention of the last q_len tokens over the held (dequantized) keys, which are already rotated
        L = len(ks[b])
        qpos = np.arange(L - case.q_len, L)
        qr = rope_complex(_norm64(q[b], norms, 1).transpose(1, 0, 2), qpos, inv, layout=spec.layout,
                          scale=spec.attention_scaling)
        ref_o = attention_quadratic(qr, keys.transpose(1, 0, 2), values.transpose(1, 0, 2), qpos, pos,
                                    scale=getattr(spec, "softmax_scale_factor", 1.0) / np.sqrt(d), causal=True,
                                    window=case.window, softcap=case.softcap).transpose(1, 0, 2)
        rel = float(np.abs(o[b].astype(np.float64) - ref_o).max() / max(np.abs(ref_o).max(), 1e-30))
        limit = {"float64": 1e-10, "float32": 2e-5, "float16": 4e-3}[case.dtype]
        worst = max(worst, rel)
        ok &= rel <= limit
    return Result(case.name, backend, worst, float(KV_ENTRY_TOLERANCES.get(case.kv_dtype, atol)), ok, seconds,
                  "" if ok else "keys, values or attention off the oracle")


#: the eps of the qk_norm cases (Qwen3's)
NORM_EPS = 1e-6


def _norm_weights(case, rng):
    """(k weights, q weights) float32 (head_dim,) of a qk_norm case, else None."""
    if not case.qk_norm:
        return None
    return tuple((1.0 + 0.5 * rng.standard_normal(case.head_dim)).astype(np.float32) for _ in range(2))


def _norm64(x, norms, which):
    """x in float64, each head normed by weights ``norms[which]`` (0: k, 1: q) when the case has them:
    ``x / sqrt(mean(x^2) + eps) * w``."""
    x = np.asarray(x, np.float64)
    if norms is None:
        return x
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + NORM_EPS) * norms[which].astype(np.float64)


class _Done(Exception):
    """The caller-tables run filled ``held`` already (the cache's run is skipped)."""


def _caller_tables(case, spec, dt, rng, backend, to_backend, to_host, norms=None):
    """The case's tokens through kv_append / paged_attention over pools and a block table owned here (the decode
    steps' appends prepared once each, :func:`rotary.prepare_kv_append`; the attention also through
    :func:`rotary.prepare_paged_attention`, which must give its bits): returns (ks, vs, q, o, held) as the cache's
    run makes them, or a failed Result."""
    from ..backends import kv_entries
    from ..kvcache.prepared import prepare_kv_append, prepare_paged_attention
    from ..kvcache.primitives import kv_append, paged_attention
    from ..kvcache.tables import slots_from_block_table

    hk, d, ps = case.kv_heads, case.head_dim, 4
    fmt = kv_entries.kv_format(case.kv_dtype)
    work = np.float64 if dt == np.float64 else np.float32
    k_norm = {} if norms is None else dict(k_norm=to_backend(norms[0]), norm_eps=NORM_EPS)
    q_norm = {} if norms is None else dict(q_norm=to_backend(norms[1]), norm_eps=NORM_EPS)
    try:
        pools = [np.zeros((12, ps, hk, d), kv_entries.entry_dtype(case.kv_dtype, dt)) for _ in range(2)]
        scales = None if fmt.limit is None else tuple(np.zeros((12, ps, hk), work) for _ in range(2))
        table = np.array([[3, 7, 1, -1], [0, 9, -1, -1], [3, 5, 10, -1]])   # page 3: the shared first page
        pools = [to_backend(p) for p in pools]
        scales = None if scales is None else tuple(to_backend(s) for s in scales)
        first = rng.standard_normal((ps, hk, d)).astype(dt), rng.standard_normal((ps, hk, d)).astype(dt)
        counts = [5, 1, 8]
        ks = [rng.standard_normal((c, hk, d)).astype(dt) for c in counts]
        vs = [rng.standard_normal((c, hk, d)).astype(dt) for c in counts]
        ks[2][:ps], vs[2][:ps] = ks[0][:ps], vs[0][:ps] = first   # the prefix both share
        seq = np.repeat(np.arange(3), counts)
        pos = np.concatenate([np.arange(c) for c in counts])
        slots = slots_from_block_table(table, seq, pos, ps)
        slots[np.flatnonzero(seq == 2)[:ps]] = -1   # sequence 2's copy of the shared page: not written again
        k_all, v_all = np.concatenate(ks), np.concatenate(vs)
        pad = np.zeros((1, hk, d), dt)   # a padding token of the step (vLLM's slot -1)
        kv_append(to_backend(np.concatenate([k_all, pad])), to_backend(np.concatenate([v_all, pad])), *pools,
                  np.append(slots, -1), np.append(pos, 0), spec=spec, scales=scales, kv_dtype=case.kv_dtype,
                  backend=backend, **k_norm)
        lens = np.array(counts)
        for _ in range(case.steps):
            k1 = rng.standard_normal((3, hk, d)).astype(dt)
            v1 = rng.standard_normal((3, hk, d)).astype(dt)
            step = prepare_kv_append(to_backend(k1), to_backend(v1), *pools,   # (a step prepared once, as an
                                     slots_from_block_table(table, np.arange(3), lens, ps), lens,   # engine does)
                                     spec=spec, scales=scales, kv_dtype=case.kv_dtype, backend=backend)
            step(to_backend(k1), to_backend(v1), *pools, scales, **k_norm)
            ks = [np.concatenate([a, k1[b:b + 1]]) for b, a in enumerate(ks)]
            vs = [np.concatenate([a, v1[b:b + 1]]) for b, a in enumerate(vs)]
            lens = lens + 1
        q = rng.standard_normal((3, case.q_len, case.heads, d)).astype(dt)
        cu = np.arange(4) * case.q_len
        options = dict(spec=spec, cu_seqlens=cu, window=case.window, softcap=case.softcap, scales=scales,
                       kv_dtype=case.kv_dtype, backend=backend)
        qb = to_backend(q.reshape(-1, case.heads, d))
        o = to_host(paged_attention(qb, *pools, table, lens, **options, **q_norm)).reshape(q.shape)
        prepared = to_host(prepare_paged_attention(qb, *pools, table, lens, **options)(qb, *pools, scales, **q_norm))
        if not np.array_equal(prepared.reshape(q.shape), o, equal_nan=True):   # the same kernel's call, prepared
            return Result(case.name, backend, float("nan"), 0.0, False, 0.0,
                          "prepare_paged_attention's run differs from paged_attention's output")
        stores = tuple(None if a is None else to_host(a).reshape((-1,) + tuple(a.shape[2:]))
                       for a in (*pools, *(scales or (None, None))))
        held = []
        for b in range(3):
            s = slots_from_block_table(table, np.full(int(lens[b]), b), np.arange(int(lens[b])), ps)
            held.append(tuple(kv_entries.gather_entries(stores, which, s, fmt, np.float64).astype(dt).astype(np.float64)
                              for which in (0, 1)))
    except Exception as exc:  # reported as a failure, not raised
        return Result(case.name, backend, float("nan"), 0.0, False, 0.0, f"{type(exc).__name__}: {exc}")
    return ks, vs, q, o, held

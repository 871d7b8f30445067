"""The bad-input catalogue: every input that once gave a silent wrong result, a crash or an error
naming the wrong thing (issue 14), with the exception (type and message words) or the exact value
it must give now. ``python -m rotary conformance --errors`` runs it; tests/test_error_catalogue.py
asserts it. Each case needs only NumPy (Numba cases are skipped without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class ErrorCase:
    """``run()`` must raise ``raises`` with every word of ``words`` in its message, or (raises=None)
    return a value for which ``check(value)`` is True. ``needs``: a backend name it requires."""
    name: str
    run: Callable
    raises: type | None = None
    words: tuple = ()
    check: Callable | None = None
    needs: str | None = None


@dataclass(frozen=True)
class ErrorResult:
    case: str
    passed: bool
    detail: str


def _x(shape=(4, 8), dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _spec(*args, **kwargs):
    from .. import RopeSpec

    return RopeSpec(*args, **kwargs)


def _apply(*args, **kwargs):
    from .. import apply

    return apply(*args, **kwargs)


def _convert_layout(**kwargs):
    from .. import convert_layout

    return convert_layout(_x(), to="half", **kwargs)


def _out_pairs_into(make_out):
    """An interleaved-to-half rotation (``out_pairs``) into ``make_out(x)``."""
    x = _x()
    return _apply(x, layout="interleaved", out_pairs="half", out=make_out(x))


def _from_config(**values):
    from .. import RopeSpec

    return RopeSpec.from_hf_config({"hidden_size": 256, "num_attention_heads": 4, "rope_theta": 1e4, **values})


def _head_spec(head):
    from .. import RopeSpec

    return RopeSpec.from_hf_config({"model_type": "deepseek_v3", "hidden_size": 256, "num_attention_heads": 4,
                                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16}, head=head)


def _config_error():
    from ..spec.hf_config import ConfigError

    return ConfigError


def _attention(seq=4, **kwargs):
    from .. import attention

    x = _x((seq, 8), np.float64)
    return attention(x, x, x, **kwargs)


def _yarn(**extra):
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, **extra}


def _mixed_precision_ok(result) -> bool:
    """fp32 q and fp64 k: k is rotated in float64 (as alone), q in float32 (as alone)."""
    from .. import apply

    q, k = _x((6, 8)), _x((6, 8), np.float64)
    return (np.array_equal(result[1], apply(k, 2**30)) and np.array_equal(result[0], apply(q, 2**30))
            and result[1].dtype == np.float64)


def _linear_state(**kwargs):
    from .. import LinearAttentionState

    defaults = dict(S=np.zeros((8, 4)), z=np.zeros(8), next_position=0, spec=_spec(8))
    defaults.update(kwargs)
    S, z, nxt = defaults.pop("S"), defaults.pop("z"), defaults.pop("next_position")
    return LinearAttentionState(S, z, nxt, **defaults)


def _linear(feature_map):
    from .. import linear_attention

    q = _x((1, 5, 2, 8))
    return linear_attention(q, q, q, seq_axis=1, feature_map=feature_map)


def _cases() -> list:
    from .. import apply_qk, convert_layout, decay_curve

    big = 2**63
    return [
        # -- silent wrong results ----------------------------------------------------------------
        ErrorCase("4-D input naming no sequence axis (was rotated along its heads)", lambda: _apply(_x((1, 16, 4, 8))),
                  ValueError, ("seq_axis=1", "layout='bshd'")),
        ErrorCase("layout and seq_axis that disagree", lambda: _apply(_x((1, 16, 4, 8)), seq_axis=2, layout="bshd"),
                  ValueError, ("layout='bshd'", "seq_axis=2")),
        ErrorCase("offset wraps past int64", lambda: _apply(_x(), big - 2), ValueError, ("offset", "int64")),
        ErrorCase("uint64 offset above int64", lambda: _apply(_x(), np.uint64(big + 5)), ValueError, ("int64",)),
        ErrorCase("offset 2**63 (was a bare OverflowError)", lambda: _apply(_x(), big), ValueError, ("int64",)),
        ErrorCase("uint64 positions above int64", lambda: _apply(_x(), np.array([big] * 4, np.uint64)), ValueError,
                  ("int64",)),
        ErrorCase("mixed fp32 q / fp64 k: each in its own precision", lambda: apply_qk(_x((6, 8)), _x((6, 8), np.float64), 2**30),
                  check=_mixed_precision_ok),
        ErrorCase("np.longdouble input", lambda: _apply(_x(dtype=np.longdouble)), TypeError, ("longdouble", "float64")),
        ErrorCase("yarn mscale < 0 (negative attention factor)", lambda: _spec(64, scaling=_yarn(mscale=-20.0,
                  mscale_all_dim=1.0)), ValueError, ("mscale", ">= 0")),
        ErrorCase("yarn mscale_all_dim < 0", lambda: _spec(64, scaling=_yarn(mscale=1.0, mscale_all_dim=-1.0)),
                  ValueError, ("mscale_all_dim",)),
        ErrorCase("decay_curve(base=inf)", lambda: decay_curve(8, 3, base=math.inf), ValueError, ("base", "finite")),
        ErrorCase("feature map returning complex", lambda: _linear(lambda a: a + 0j), TypeError,
                  ("feature_map(q)", "real floating", "complex")),
        ErrorCase("LinearAttentionState(feature_map='nope')", lambda: _linear_state(feature_map="nope"), ValueError,
                  ("feature_map", "'nope'")),
        ErrorCase("negative seq_len in angles", lambda: _spec(8).angles(np.arange(3), seq_len=-1), ValueError,
                  ("seq_len", ">= 1")),
        ErrorCase("negative seq_len in cos_sin", lambda: _spec(8).cos_sin(np.arange(3), seq_len=-4), ValueError,
                  ("seq_len",)),
        ErrorCase("negative seq_len in attention_scaling_at", lambda: _spec(8).attention_scaling_at(-1), ValueError,
                  ("seq_len",)),
        ErrorCase("string seq_len", lambda: _spec(8).cos_sin(np.arange(3), seq_len="5"), TypeError,
                  ("seq_len", "integer", "str")),
        ErrorCase("cos_sin(dtype=np.int32)", lambda: _spec(8).cos_sin(np.arange(3), dtype=np.int32), TypeError,
                  ("dtype", "floating", "int32")),
        ErrorCase("next_position past int64", lambda: _linear_state_call(np.array([big - 3, big - 2, big - 1])),
                  ValueError, ("int64",)),
        ErrorCase("state resumed past int64", lambda: _linear_state_call(None, start=big - 2), ValueError,
                  ("int64",)),
        # -- crashes -----------------------------------------------------------------------------
        ErrorCase("batch of size 0 with (batch, seq) positions",
                  lambda: _apply(_x((0, 3, 8)), np.zeros((0, 3), np.int64), seq_axis=1), check=lambda y: y.shape == (0, 3, 8)),
        ErrorCase("longrope original_max_position_embeddings=1", lambda: _spec(8, scaling={
                  "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
                  "original_max_position_embeddings": 1}, max_position_embeddings=8), ValueError,
                  ("original_max_position_embeddings", ">= 2")),
        ErrorCase("ntk factor 1e300 (overflow at first use)", lambda: _spec(8, scaling={"rope_type": "ntk",
                  "factor": 1e300}), ValueError, ("cannot be evaluated", "Overflow")),
        ErrorCase("convert_layout of a 0-d array", lambda: convert_layout(np.ones(()), to="half"), ValueError,
                  ("at least 1 dimension",)),
        ErrorCase("feature map returning a list", lambda: _linear(lambda a: a.tolist()), TypeError,
                  ("feature_map(q)", "list")),
        ErrorCase("LinearAttentionState(S=list)", lambda: _linear_state(S=[[0.0] * 4] * 8), TypeError,
                  ("state S", "list")),
        # -- errors that named the wrong thing ---------------------------------------------------
        ErrorCase("scaling=('linear', 2.0)", lambda: _spec(8, scaling=("linear", 2.0)), TypeError,
                  ("scaling must be a dict",)),
        ErrorCase("big-endian array on Numba", lambda: _apply(_x().astype(">f4"), backend="numba"), TypeError,
                  ("big-endian", ">f4"), needs="numba"),
        ErrorCase("longdouble on Numba", lambda: _apply(_x(dtype=np.longdouble), backend="numba"), TypeError,
                  ("longdouble",)),
        ErrorCase("head_dim=0", lambda: _spec(0), ValueError, ("head_dim", ">= 1")),
        ErrorCase("head_dim=1 (was reported as rotary_dim)", lambda: _spec(1), ValueError, ("head_dim", ">= 2")),
        # -- rotary_offset ([nope | rope] heads) ----------------------------------------------------
        ErrorCase("rotary_offset=-1", lambda: _spec(24, rotary_offset=-1), ValueError, ("rotary_offset", ">= 0")),
        ErrorCase("rotary_offset=1.5", lambda: _spec(24, rotary_offset=1.5), TypeError, ("rotary_offset", "integer")),
        ErrorCase("rotary_offset=True", lambda: _spec(24, rotary_offset=True), TypeError, ("rotary_offset", "bool")),
        ErrorCase("rotary_offset + rotary_dim > head_dim", lambda: _spec(24, rotary_dim=16, rotary_offset=12),
                  ValueError, ("rotary_offset", "rotary_dim", "head_dim (24)")),
        ErrorCase("rotary_offset leaves no pair", lambda: _spec(8, rotary_offset=7), ValueError,
                  ("head_dim", "rotary_offset", ">= 2")),
        ErrorCase("rotary_offset spec on a narrower head", lambda: _apply(_x((4, 20)), spec=_spec(24, rotary_offset=8)),
                  ValueError, ("head_dim (24)", "x.shape[-1] (20)", "rotary_offset=8")),
        ErrorCase("apply(rotary_offset=-2)", lambda: _apply(_x(), rotary_offset=-2), ValueError,
                  ("rotary_offset", ">= 0")),
        ErrorCase("convert_layout rotary_offset + rotary_dim > head", lambda: _convert_layout(rotary_offset=6, rotary_dim=4),
                  ValueError, ("rotary_offset", "rotary_dim", "x.shape[-1] (8)")),
        # -- out_pairs (pairs written in another layout than read: never in place) ----------------
        ErrorCase("apply(out_pairs='full')", lambda: _apply(_x(), out_pairs="full"), ValueError,
                  ("out_pairs", "'half'", "'interleaved'", "'full'")),
        ErrorCase("apply(out_pairs=...) in place", lambda: _out_pairs_into(lambda x: x), ValueError,
                  ("out is x itself", "out_pairs='half'", "separate buffer")),
        ErrorCase("apply(out_pairs=...) into a view of x", lambda: _out_pairs_into(lambda x: x.view()), ValueError,
                  ("out shares memory with x", "out_pairs", "separate buffer")),
        ErrorCase("seq_axis out of range", lambda: _apply(_x((2, 4, 8)), seq_axis=5), ValueError,
                  ("seq_axis", "[0, 1]", "[-3, -2]", "got 5")),
        # -- HF config values (named by their config key, never truncated) -------------------------
        *[ErrorCase(f"from_hf_config {key}={value!r}", (lambda k=key, v=value: _from_config(**{k: v})), _config_error(),
                    (f"config['{key}']", want))
          for key, value, want in (("head_dim", 64.7, "integer"), ("head_dim", "64", "integer"),
                                   ("rope_theta", "abc", "finite number"),
                                   ("partial_rotary_factor", "0.5", "finite number"),
                                   ("hidden_size", "256", "integer"), ("num_attention_heads", 0, ">= 1"))],
        ErrorCase("from_hf_config head='q'", lambda: _head_spec("q"), ValueError, ("head must be one of", "'q'")),
        ErrorCase("from_hf_config head='indexer' without a DSA config", lambda: _head_spec("indexer"),
                  _config_error(), ("head='indexer'", "index_head_dim")),
        *[ErrorCase(f"from_hf_config {family} config.json without per-layer-type rope_parameters",
                    (lambda f=family: _from_config(model_type=f)), _config_error(),
                    (f"a {family} config.json", "per layer type", "AutoConfig"))
          for family in ("deepseek_v4", "dots3_note")],
        # -- softmax attention scalars ------------------------------------------------------------
        ErrorCase("attention scale=nan", lambda: _attention(scale=float("nan")), ValueError, ("scale", "finite")),
        ErrorCase("attention scale=inf", lambda: _attention(scale=math.inf), ValueError, ("scale", "finite")),
        ErrorCase("attention scale=-0.5", lambda: _attention(scale=-0.5), ValueError, ("scale", "> 0")),
        ErrorCase("attention scale=np.float32(0.25), causal=np.bool_(True)",
                  lambda: _attention(scale=np.float32(0.25), causal=np.bool_(True)), check=lambda o: o.shape == (4, 8)),
        ErrorCase("attention with sequence length 0", lambda: _attention(seq=0), check=lambda o: o.shape == (0, 8)),
        ErrorCase("attention q_mask_positions without k_mask_positions",
                  lambda: _attention(causal=True, q_mask_positions=np.arange(4)), ValueError,
                  ("q_mask_positions", "k_mask_positions", "both")),
        ErrorCase("attention mask positions without causal",
                  lambda: _attention(q_mask_positions=np.arange(4), k_mask_positions=np.arange(4)), ValueError,
                  ("q_mask_positions", "causal=True")),
        ErrorCase("attention k_mask_positions of the wrong length",
                  lambda: _attention(causal=True, q_mask_positions=np.arange(4), k_mask_positions=np.arange(3)),
                  ValueError, ("k_mask_positions", "shape")),
        ErrorCase("attention float q_mask_positions",
                  lambda: _attention(causal=True, q_mask_positions=np.arange(4.0), k_mask_positions=np.arange(4)),
                  TypeError, ("q_mask_positions", "integer dtype")),
        # -- the cos/sin table cache ---------------------------------------------------------------
        ErrorCase("set_table_cache_limit(-1)", lambda: _cache_limit(-1), ValueError, ("nbytes", ">= 0")),
        ErrorCase("set_table_cache_limit('1MB')", lambda: _cache_limit("1MB"), TypeError, ("nbytes", "int")),
        ErrorCase("set_table_cache_limit(True)", lambda: _cache_limit(True), TypeError, ("nbytes", "int")),
        ErrorCase("linear_attention(decay=0.5, causal=False)", lambda: _linear_decay(0.5, causal=False), ValueError,
                  ("decay", "causal=True")),
        ErrorCase("linear_attention(decay=1.5)", lambda: _linear_decay(1.5), ValueError, ("decay", "(0, 1]")),
        ErrorCase("linear_attention(decay=0)", lambda: _linear_decay(0.0), ValueError, ("decay", "(0, 1]")),
        ErrorCase("linear_attention(decay of 3 values, 2 k/v heads)", lambda: _linear_decay([0.5, 0.6, 0.7]),
                  ValueError, ("decay", "shape")),
        # -- issue 25 (generated cases) ---------------------------------------------------------
        ErrorCase("positions=[] for zero tokens (was 'float positions')", lambda: _apply(_x((0, 8)), []),
                  check=lambda y: y.shape == (0, 8)),
        ErrorCase("positions=[] for 4 tokens", lambda: _apply(_x(), []), ValueError, ("positions", "sequence length 4")),
        ErrorCase("packed seqlen_offsets wrapping past int64", lambda: _apply(_x((7, 8)), seq_axis=0, cu_seqlens=[0, 3, 7],
                                                                             seqlen_offsets=[big - 2, 0]),
                  ValueError, ("seqlen_offsets[0]", "int64")),
        ErrorCase("packed seqlen_offsets=2**63", lambda: _apply(_x((7, 8)), seq_axis=0, cu_seqlens=[0, 3, 7],
                                                                 seqlen_offsets=big), ValueError, ("seqlen_offsets", "int64")),
        ErrorCase("rerotate by int64 deltas past 2**63 (wrapped)", _rerotate_far, check=lambda err: err < 1e-9),
        ErrorCase("causal linear attention: a later token's NaN in earlier outputs", _linear_later_nan,
                  check=lambda ok: ok is True),
        ErrorCase("softmax attention: a masked key's NaN in the outputs", _softmax_masked_nan, check=lambda ok: ok is True),
        ErrorCase("mrope_section not summing to rotary_dim/2", lambda: _spec(8, mrope_section=[1, 1, 1]), ValueError,
                  ("mrope_section", "rotary_dim/2")),
        ErrorCase("cu_seqlens past the token count", lambda: _apply(_x((7, 8)), seq_axis=0, cu_seqlens=[0, 3, 8]),
                  ValueError, ("cu_seqlens", "token count 7")),
        # -- the KV cache and its primitives (issue 41) ---------------------------------------------
        ErrorCase("kv_append of keys that are a view of the pool (Numba wrote wrong keys)",
                  lambda: _kv_append_own_view("numba"), ValueError, ("k shares memory with k_pool",), needs="numba"),
        ErrorCase("kv_append of keys that are a view of the pool, NumPy", lambda: _kv_append_own_view("numpy"),
                  ValueError, ("k shares memory with k_pool",)),
        ErrorCase("kv_append to a slot outside the pools", lambda: _kv_append(slots=[0, 99]), ValueError,
                  ("slots[1] = 99", "outside the pools")),
        ErrorCase("kv_append with a repeated slot", lambda: _kv_append(slots=[3, 3]), ValueError, ("repeat",)),
        ErrorCase("KVCache float8 on Numba (took the reference silently)",
                  lambda: _cache(backend="numba", kv_dtype="float8_e4m3"), NotImplementedError,
                  ("numba", "kv_dtype='float8_e4m3'"), needs="numba"),
        ErrorCase("slide on a dynamic-NTK cache (keys unlike a fresh cache)", lambda: _cache_slide_dynamic(),
                  ValueError, ("slide", "depend on the sequence length")),
        ErrorCase("slide(sinks=1.5) (truncated to 1)", lambda: _cache().slide(sinks=1.5, window=2), TypeError,
                  ("sinks", "integer")),
        ErrorCase("slide(sinks=None) (a bare int() TypeError)", lambda: _cache().slide(sinks=None, window=2),
                  TypeError, ("sinks", "integer")),
        ErrorCase("KVCache.free(seq_ids=[]) (a dtype message)", lambda: _cache().free([]), check=lambda r: r is None),
        ErrorCase("int32 keys told to make an int32 cache", lambda: _cache().append(*[np.zeros((2, 1, 1, 8), np.int32)] * 2),
                  TypeError, ("cast k to float32",)),
        ErrorCase("paged_attention reading a page outside the pool", lambda: _paged(block_table=[[0], [7]]),
                  ValueError, ("block_table[1, 0] = 7", "not a page of the pool")),
        # -- documented mappings -----------------------------------------------------------------
        ErrorCase("linear factor in (0, 1) (MLX scale=2)", lambda: _linear_below_one(),
                  check=lambda ok: ok is True),
    ]


def _rerotate_far() -> float:
    """max |rerotate(apply(k, src), src, dst) - apply(k, dst)| with dst - src wrapping int64."""
    from .. import rerotate

    k = _x((4, 8), np.float64)
    src = np.array([2**62, 2**62 + 1, -(2**62), 5], np.int64)
    dst = np.array([-(2**62), 2**62, 2**62, 2**61], np.int64)
    return float(np.max(np.abs(rerotate(_apply(k, src), src, dst) - _apply(k, dst))))


def _linear_later_nan() -> bool:
    """A NaN in v at token 6: outputs before it stay finite, from it on NaN (chunk 64: one chunk)."""
    import warnings

    from .. import linear_attention

    q = _x((1, 10, 2, 8))
    v = q.copy()
    v[0, 6, 0, 1] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = linear_attention(q, q, v, seq_axis=1, causal=True, backend="numpy")
    return bool(np.isfinite(o[0, :6]).all() and np.isnan(o[0, 6:, 0, 1]).all())


def _softmax_masked_nan() -> bool:
    """A NaN in v of key 7: causal queries 0..6 never see it (exactly finite), 7.. do."""
    import warnings

    from .. import attention

    q = _x((1, 10, 8))
    v = q.copy()
    v[0, 7, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = attention(q, q, v, causal=True, block_size=4, seq_axis=1)
    return bool(np.isfinite(o[0, :7]).all() and np.isnan(o[0, 7:, 0]).all())


def _linear_state_call(positions, start=None):
    from .. import linear_attention

    q = _x((1, 3, 1, 8))
    state = None if start is None else _linear_state(S=np.zeros((1, 1, 8, 8), np.float32), z=np.zeros((1, 1, 8), np.float32),
                                                      next_position=start)
    return linear_attention(q, q, q, positions, seq_axis=1, causal=True, state=state, return_state=True)


def _linear_decay(decay, causal=True):
    from .. import linear_attention

    q = _x((1, 5, 2, 8))
    return linear_attention(q, q, q, seq_axis=1, causal=causal, decay=decay)


def _pools(pages=4, page_size=2, heads=1, head_dim=8):
    shape = (pages, page_size, heads, head_dim)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def _kv_append(slots, backend="auto"):
    from .. import kv_append

    k = _x((len(slots), 1, 8))
    return kv_append(k, k, *_pools(), np.array(slots), np.arange(len(slots)), spec=_spec(8), backend=backend)


def _kv_append_own_view(backend):
    from .. import kv_append

    k_pool, v_pool = _pools()
    k = k_pool.reshape(8, 1, 8)[2:5]
    return kv_append(k, k.copy(), k_pool, v_pool, np.array([3, 4, 5]), np.arange(3), spec=_spec(8), backend=backend)


def _cache(backend="auto", kv_dtype=None, spec=None):
    from .. import KVCache

    return KVCache(spec or _spec(8), batch=2, kv_heads=1, head_dim=8, capacity=8, backend=backend, kv_dtype=kv_dtype)


def _cache_slide_dynamic():
    cache = _cache(spec=_spec(8, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4))
    k = _x((2, 6, 1, 8))
    cache.append(k, k)
    return cache.slide(sinks=1, window=2)


def _paged(block_table):
    from .. import paged_attention

    return paged_attention(_x((2, 1, 1, 8)), *_pools(4), np.array(block_table), np.array([1, 2]))


def _cache_limit(nbytes):
    from .. import set_table_cache_limit

    set_table_cache_limit(set_table_cache_limit(nbytes))   # restores the previous limit when accepted


def _linear_below_one() -> bool:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = _spec(16, scaling={"rope_type": "linear", "factor": 0.5})
    x = _x((6, 16), np.float64)
    return bool(np.allclose(_apply(x, spec=spec), _apply(x, np.arange(6) * 2, spec=_spec(16)), rtol=0, atol=1e-15))


def cases() -> list:
    """Every :class:`ErrorCase`."""
    return _cases()


def run_case(case: ErrorCase) -> ErrorResult:
    if case.needs is not None:
        from ..backends import available_backends

        ok, reason = available_backends()[case.needs]
        if not ok:
            return ErrorResult(case.name, True, f"skipped: {reason}")
    try:
        value = case.run()
    except Exception as exc:  # noqa: BLE001 - the point is to see what it raises
        message = str(exc)
        if case.raises is None:
            return ErrorResult(case.name, False, f"raised {type(exc).__name__}: {message}")
        if type(exc) is not case.raises:
            return ErrorResult(case.name, False, f"raised {type(exc).__name__} (want {case.raises.__name__}): {message}")
        missing = [w for w in case.words if w not in message]
        if missing:
            return ErrorResult(case.name, False, f"message lacks {missing}: {message}")
        return ErrorResult(case.name, True, f"{type(exc).__name__}: {message}")
    if case.raises is not None:
        return ErrorResult(case.name, False, f"did not raise {case.raises.__name__}")
    try:
        good = bool(case.check(value))
    except Exception as exc:  # noqa: BLE001
        return ErrorResult(case.name, False, f"check raised {type(exc).__name__}: {exc}")
    return ErrorResult(case.name, good, "value as required" if good else f"wrong value: {value!r}"[:200])


def run() -> list:
    """:class:`ErrorResult` of every case."""
    return [run_case(c) for c in cases()]

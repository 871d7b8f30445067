"""rotary side by side with what users pick instead, in one process, interleaved (issue 23).

    PYTHONPATH=. python benchmarks/bench_peers.py            # full: about 5-10 minutes on 2 cores
    PYTHONPATH=. python benchmarks/bench_peers.py --quick    # shorter sequences, fewer rounds: < 3 minutes

Cases (fp32, spec ``RopeSpec(head_dim, base=500000)``: Llama-3's base, no scaling, so that every peer
computes the same frequencies):

- **prefill**: Llama-3-8B, q (1, T, 32, 128) and k (1, T, 8, 128) in BSHD memory, positions 0..T-1
  (T = 4096; 1024 with --quick);
- **decode**: 32 sequences x 1 token, q (32, 1, 32, 128), k (32, 1, 8, 128), one random position in
  100..8000 per sequence;
- **linear**: causal linear attention with RoPE in the numerator (elu + 1 features), H = 8, d = dv = 64,
  T = 8192 (2048 with --quick), chunk 64.

Contenders: rotary (Numba; apply_qk with new outputs and with ``out=``, ``rotary.Rope`` new / out= /
in place at decode); HF transformers eager (``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` on
BHSD views of the same memory, cos/sin made per call as HF's forward does); the same function under
``torch.compile`` (inductor; its compile time is reported apart and not in the timing); JAX ``jit``
with precomputed cos/sin tables (rotary's, gathered by position inside the jit) and with the angles
computed inside the jit; MLX ``mx.fast.rope`` on the CPU where ``mlx`` is installed; plain NumPy (HF's
formula ``x*cos + rotate_half(x)*sin`` on rotary's tables); and a copy of the same bytes (q and k read
and written once: a Numba ``prange`` copy on the same threads, and ``q.copy(), k.copy()``). For linear
attention: rotary's Numba kernel against a chunked form written here in torch (eager and
``torch.compile``) and in JAX (``jit`` + ``lax.scan`` over chunks), both on rotary's cos/sin tables.

Every contender's output is checked against rotary's before it is timed: relative error
``max|got - want| / max|want|`` within the tolerance below, else it is rejected (listed, not timed).
Contenders that compute the angles in fp32 (``position * inv_freq`` rounded to fp32: HF eager and
compiled, JAX angles-in-jit, MLX) are off by up to about ``position * 2**-23`` radians (the angle's
last bit), so their tolerance grows with the largest position; the others use rotary's tables
(angles in float64, rounded once) and must agree to fp32 rounding.

Timing: every contender runs once (warm-up, compile), then rounds: each round times every
contender in turn (``calls`` calls each, sized to ~``--round-ms``), best per-call time of the rounds
reported (median kept in the JSON). Threads: ``--threads`` (default 2) for BLAS/OpenMP/Numba/torch,
set before those are imported, with ``OMP_WAIT_POLICY=PASSIVE`` unless set (spinning OpenMP threads of
one library would take the cores from the next contender); JAX and MLX use their own pools. Writes
benchmarks/results/peers.json and peers.png and says what it skipped.
"""

from __future__ import annotations

import argparse
import os
import sys

THREADS_DEFAULT = 2

#: relative tolerance of contenders on rotary's tables (fp32 rounding of the same products)
TOL_EXACT = 2e-5
#: relative tolerance of linear attention's chunked forms (fp32 sums over T tokens in another order)
TOL_LINEAR = 2e-4


def tol_fp32_angles(max_position: int) -> float:
    """Tolerance of a contender computing ``position * inv_freq`` in fp32: twice the angle's last bit at the
    largest position (its rounding, and inv_freq's own), plus fp32 rounding of the rotation."""
    return TOL_EXACT + 2 * max(1, max_position) * 2.0 ** -23


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T=1024 prefill, T=2048 linear attention, 3 rounds")
    p.add_argument("--threads", type=int, default=THREADS_DEFAULT, help="threads per implementation (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick 3)")
    p.add_argument("--round-ms", type=float, default=None, help="time per contender per round (default 60; quick 25)")
    p.add_argument("--cases", default="prefill,decode,linear", help="comma-separated subset of the cases")
    p.add_argument("--prefill-T", type=int, default=None, help="prefill tokens (default 4096; quick 1024)")
    p.add_argument("--linear-T", type=int, default=None, help="linear-attention tokens (default 8192; quick 2048)")
    p.add_argument("--skip", default="", help="comma-separated contender families to leave out: hf, compile, jax, "
                                               "mlx, numpy, copy")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/peers.json)")
    p.add_argument("--figure", default=None, help="figure (default next to the JSON, .png); 'none' for none")
    return p.parse_args(argv)


def _set_threads(n: int) -> None:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)
    # OpenMP threads that spin after a parallel region (the default) take the cores from the next
    # contender of an interleaved run: torch's decode calls measured 28-57 ms instead of ~0.5 ms that way
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


if __name__ == "__main__":
    ARGS = _parse(sys.argv[1:])
    _set_threads(ARGS.threads)

import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import rotary  # noqa: E402
from rotary.spec import tables as _tables  # noqa: E402

BASE = 500000.0


class Contender:
    """A timed implementation: ``fn()`` runs one call on prepared inputs and returns its outputs (NumPy-
    convertible, in the case's layout, via ``result(out)``); ``fp32_angles`` says which tolerance applies."""

    def __init__(self, name, fn, *, family, fp32_angles=False, result=None, setup_s=None, note="", checked=True):
        self.name, self.fn, self.family, self.fp32_angles, self.checked = name, fn, family, fp32_angles, checked
        self.result = result or (lambda out: out)
        self.setup_s, self.note = setup_s, note


def rel_error(got, want) -> float:
    """max |got - want| / max |want| over the arrays of a result (a tuple of arrays, or one)."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    if len(got) != len(want):
        return float("inf")
    err, scale = 0.0, 0.0
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return float("inf")
        if not np.all(np.isfinite(g)):
            return float("inf")
        err = max(err, float(np.max(np.abs(g - w))) if g.size else 0.0)
        scale = max(scale, float(np.max(np.abs(w))) if w.size else 0.0)
    return err / scale if scale else err


def check(contender, want, tol):
    """(accepted, relative error): the contender's output against rotary's ``want`` within ``tol``."""
    try:
        got = contender.result(contender.fn())
    except Exception as exc:   # a contender that cannot run this case is reported, not timed
        return False, f"{type(exc).__name__}: {exc}"
    err = rel_error(got, want)
    return err <= tol, err


def time_interleaved(contenders, rounds: int, round_s: float):
    """{name: (best s per call, median s per call, calls per round)}; every contender once per round."""
    calls = {}
    for c in contenders:
        t = time.perf_counter()
        c.fn()
        one = max(time.perf_counter() - t, 1e-7)
        calls[c.name] = max(1, min(5000, int(round_s / one)))
    per_call = {c.name: [] for c in contenders}
    for _ in range(rounds):
        for c in contenders:
            n = calls[c.name]
            fn = c.fn
            t = time.perf_counter()
            for _ in range(n):
                fn()
            per_call[c.name].append((time.perf_counter() - t) / n)
    return {name: (min(ts), statistics.median(ts), calls[name]) for name, ts in per_call.items()}


# -- peers -------------------------------------------------------------------------------------------
def _half_rotate_np(x, cos, sin):
    """HF's formula in NumPy: x*cos + rotate_half(x)*sin (cos/sin full width, broadcast on heads)."""
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def exact_tables(spec, max_position: int):
    """rotary's fp32 cos/sin table (angles in float64, rounded once), rows 0..max_position."""
    cos, sin, _ = _tables.lookup(spec, np.array([0, max_position], np.int64), dtype=np.float32)
    return np.ascontiguousarray(cos[:max_position + 1]), np.ascontiguousarray(sin[:max_position + 1])


def numba_copy(threads):
    """A 2-thread (``threads``) copy of q and k into preallocated outputs: the bytes rotary reads and writes."""
    import numba

    @numba.njit(parallel=True)   # not cached: a cache written by the test's import of this file names no importable module
    def pcopy(src, dst):
        n = src.size
        step = (n + 63) // 64
        for i in numba.prange(64):
            lo = i * step
            hi = min(n, lo + step)
            dst[lo:hi] = src[lo:hi]   # a memcpy per block: an element loop here was not vectorised (2-3x slower)

    def make(q, k):
        qo, ko = np.empty_like(q), np.empty_like(k)
        qf, kf, qof, kof = q.reshape(-1), k.reshape(-1), qo.reshape(-1), ko.reshape(-1)

        def run():
            pcopy(qf, qof)
            pcopy(kf, kof)
            return qo, ko
        return run
    return make


def hf_contenders(q, k, positions, threads, compile_too, skipped, tag):
    """HF eager (and torch.compile'd) LlamaRotaryEmbedding + apply_rotary_pos_emb on BHSD views of q and k."""
    try:
        import torch
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    except Exception as exc:
        skipped["HF eager"] = f"torch/transformers not importable: {exc}"
        return []
    torch.set_num_threads(threads)
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_theta=BASE,
                         max_position_embeddings=131072, head_dim=q.shape[-1])
    rope = LlamaRotaryEmbedding(config)
    tq, tk = torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2)   # BHSD views, as HF's attention
    pos = torch.from_numpy(np.broadcast_to(positions, (q.shape[0], q.shape[1])).copy())

    def forward(q_, k_, position_ids):
        cos, sin = rope(q_, position_ids)
        return apply_rotary_pos_emb(q_, k_, cos, sin)

    def to_bshd(out):
        return tuple(o.transpose(1, 2).numpy() for o in out)

    def eager():
        with torch.inference_mode():
            return forward(tq, tk, pos)

    out = [Contender("HF eager (torch)", eager, family="hf", fp32_angles=True, result=to_bshd,
                     note=f"torch {torch.__version__}, transformers {__import__('transformers').__version__}")]
    if compile_too:
        try:
            compiled = torch.compile(forward, dynamic=False)
            t = time.perf_counter()
            with torch.inference_mode():
                compiled(tq, tk, pos)
            compile_s = time.perf_counter() - t

            def run_compiled():
                with torch.inference_mode():
                    return compiled(tq, tk, pos)
            out.append(Contender("HF under torch.compile (inductor)", run_compiled, family="compile", fp32_angles=True,
                                 result=to_bshd, setup_s=compile_s))
        except Exception as exc:
            skipped[f"torch.compile ({tag})"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def jax_contenders(q, k, positions, cos_t, sin_t, inv_freq, skipped):
    """JAX jit: precomputed tables gathered by position, and the angles computed in the jit (fp32)."""
    try:
        import jax
        import jax.numpy as jnp
    except Exception as exc:
        skipped["JAX"] = f"jax not importable: {exc}"
        return []
    jq, jk = jnp.asarray(q), jnp.asarray(k)
    jpos = jnp.asarray(np.broadcast_to(positions, (q.shape[0], q.shape[1])).astype(np.int32))
    jcos, jsin = jnp.asarray(cos_t), jnp.asarray(sin_t)
    jinv = jnp.asarray(inv_freq.astype(np.float32))

    def rot(x, c, s):   # x (B, T, H, D); c, s (B, T, D/2)
        h = x.shape[-1] // 2
        c, s = c[:, :, None, :], s[:, :, None, :]
        a, b = x[..., :h], x[..., h:]
        return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    @jax.jit
    def tables(q_, k_, pos, cos_, sin_):
        c, s = cos_[pos], sin_[pos]
        return rot(q_, c, s), rot(k_, c, s)

    @jax.jit
    def angles(q_, k_, pos):
        ang = pos.astype(jnp.float32)[..., None] * jinv
        c, s = jnp.cos(ang), jnp.sin(ang)
        return rot(q_, c, s), rot(k_, c, s)

    def run_tables():
        return jax.block_until_ready(tables(jq, jk, jpos, jcos, jsin))

    def run_angles():
        return jax.block_until_ready(angles(jq, jk, jpos))

    to_np = (lambda out: tuple(np.asarray(o) for o in out))
    note = f"jax {jax.__version__}, XLA's own CPU thread pool"
    return [Contender("JAX jit, precomputed tables", run_tables, family="jax", result=to_np, note=note),
            Contender("JAX jit, angles in jit", run_angles, family="jax", fp32_angles=True, result=to_np, note=note)]


def mlx_contender(q, k, positions, skipped):
    """MLX ``mx.fast.rope`` on the CPU (BHSD input; per-sequence offsets for decode)."""
    try:
        import mlx.core as mx
    except Exception as exc:
        skipped["MLX"] = f"mlx not importable ({exc}); pip install 'mlx[cpu]' where a wheel exists"
        return []
    mx.set_default_device(mx.cpu)
    B, T = q.shape[0], q.shape[1]
    pos = np.broadcast_to(positions, (B, T))
    if not np.all(pos == pos[:, :1] + np.arange(T)):
        skipped["MLX"] = "mx.fast.rope takes an offset per sequence, not arbitrary positions"
        return []
    mq, mk = mx.array(np.swapaxes(q, 1, 2).copy()), mx.array(np.swapaxes(k, 1, 2).copy())   # BHSD arrays
    offset = int(pos[0, 0]) if np.all(pos[:, 0] == pos[0, 0]) else mx.array(pos[:, 0].astype(np.int32))
    D = q.shape[-1]

    def run():
        out = (mx.fast.rope(mq, D, traditional=False, base=BASE, scale=1.0, offset=offset),
               mx.fast.rope(mk, D, traditional=False, base=BASE, scale=1.0, offset=offset))
        mx.eval(*out)
        return out

    return [Contender("MLX CPU mx.fast.rope", run, family="mlx", fp32_angles=True,
                      result=lambda out: tuple(np.swapaxes(np.array(o), 1, 2) for o in out),
                      note=f"mlx {mx.__version__}, input in BHSD (its layout)")]


# -- the cases ---------------------------------------------------------------------------------------
def rope_case(name, q, k, positions, spec, args, skipped, *, decode):
    """Contenders of one rotation case; positions (B, T) or (T,) int64 for every contender."""
    B, T, _, D = q.shape
    pos2 = np.ascontiguousarray(np.broadcast_to(positions, (B, T)))
    max_pos = int(pos2.max())
    cos_t, sin_t = exact_tables(spec, max_pos)
    want = rotary.apply_qk(q, k, pos2, spec=spec, seq_axis=1, backend="numba")
    qo, ko = np.empty_like(q), np.empty_like(k)
    rope_pos = pos2 if decode else None
    cands = [Contender("rotary apply_qk (Numba)", lambda: rotary.apply_qk(q, k, rope_pos, spec=spec, seq_axis=1,
                                                                          backend="numba"), family="rotary"),
             Contender("rotary apply_qk, out=", lambda: rotary.apply_qk(q, k, rope_pos, spec=spec, seq_axis=1,
                                                                        backend="numba", out=(qo, ko)),
                       family="rotary")]
    if decode:
        rope = rotary.Rope(spec, backend="numba", dtype=np.float32, max_positions=8192, seq_axis=-2)
        ro_q, ro_k = np.empty_like(q), np.empty_like(k)
        qi, ki = q.copy(), k.copy()
        cands += [Contender("rotary.Rope, new outputs", lambda: rope(q, k, pos2, seq_axis=1), family="rotary"),
                  Contender("rotary.Rope, out=", lambda: rope(q, k, pos2, seq_axis=1, out=(ro_q, ro_k)),
                            family="rotary"),
                  Contender("rotary.Rope, in place (rotates its own copy)",
                            lambda: rope(qi, ki, pos2, seq_axis=1, out=(qi, ki)), family="rotary",
                            checked=False)]   # in place: rotates again every call (the same code as out=)
    skip = set(filter(None, args.skip.split(",")))
    if "hf" not in skip:
        cands += hf_contenders(q, k, pos2, args.threads, "compile" not in skip, skipped, name)
    if "jax" not in skip:
        cands += jax_contenders(q, k, pos2, cos_t, sin_t, spec.inv_freq(), skipped)
    if "mlx" not in skip:
        cands += mlx_contender(q, k, pos2, skipped)
    if "numpy" not in skip:
        def plain_numpy():
            c = np.concatenate([cos_t, cos_t], axis=-1)[pos2][:, :, None, :]
            s = np.concatenate([sin_t, sin_t], axis=-1)[pos2][:, :, None, :]
            return _half_rotate_np(q, c, s), _half_rotate_np(k, c, s)
        cands.append(Contender("plain NumPy (HF's formula)", plain_numpy, family="numpy"))
    if "copy" not in skip:
        cands.append(Contender(f"copy of the same bytes, {args.threads} threads (Numba prange)",
                               numba_copy(args.threads)(q, k), family="copy", checked=False))
        cands.append(Contender("q.copy(), k.copy()", lambda: (q.copy(), k.copy()), family="copy", checked=False))
    return cands, want, max_pos


def linear_case(T, H, d, args, skipped, rng, chunk=64, eps=1e-6):
    """Causal linear attention (elu + 1 features, RoPE in the numerator) on (1, T, H, d) BSHD inputs."""
    spec = rotary.RopeSpec(d, base=10000.0)
    q, k, v = (rng.standard_normal((1, T, H, d), dtype=np.float32) * 0.5 for _ in range(3))
    want = rotary.linear_attention(q, k, v, causal=True, feature_map="elu", spec=spec, seq_axis=1, backend="numba",
                                   chunk=chunk, eps=eps)
    cos_t, sin_t = exact_tables(spec, T - 1)
    cands = [Contender("rotary linear_attention (Numba)",
                       lambda: rotary.linear_attention(q, k, v, causal=True, feature_map="elu", spec=spec, seq_axis=1,
                                                       backend="numba", chunk=chunk, eps=eps), family="rotary")]
    heads_first = [np.ascontiguousarray(np.swapaxes(a[0], 0, 1)) for a in (q, k, v)]   # (H, T, d), the peers' layout
    to_bshd = (lambda o: np.swapaxes(np.asarray(o), 0, 1)[None])
    skip = set(filter(None, args.skip.split(",")))
    if "hf" not in skip or "compile" not in skip:
        try:
            import torch
            torch.set_num_threads(args.threads)
            tq, tk, tv = (torch.from_numpy(a) for a in heads_first)
            tcos, tsin = torch.from_numpy(cos_t), torch.from_numpy(sin_t)
            if "hf" not in skip:
                cands.append(Contender("torch eager, chunked (written here)",
                                       lambda: torch_linear(tq, tk, tv, tcos, tsin, chunk, eps), family="hf",
                                       result=lambda o: to_bshd(o.numpy()), note=f"torch {torch.__version__}"))
            if "compile" not in skip:
                compiled = torch.compile(torch_linear, dynamic=False)
                t0 = time.perf_counter()
                compiled(tq, tk, tv, tcos, tsin, chunk, eps)
                setup = time.perf_counter() - t0
                cands.append(Contender("torch.compile, chunked (written here)",
                                       lambda: compiled(tq, tk, tv, tcos, tsin, chunk, eps), family="compile",
                                       result=lambda o: to_bshd(o.numpy()), setup_s=setup))
        except Exception as exc:
            skipped["torch (linear)"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if "jax" not in skip:
        try:
            import jax
            run = jax_linear(chunk, eps)
            jargs = [jax.numpy.asarray(a) for a in (*heads_first, cos_t, sin_t)]
            t0 = time.perf_counter()
            jax.block_until_ready(run(*jargs))
            setup = time.perf_counter() - t0
            cands.append(Contender("JAX jit + lax.scan, chunked (written here)",
                                   lambda: jax.block_until_ready(run(*jargs)), family="jax",
                                   result=lambda o: to_bshd(o), setup_s=setup, note=f"jax {jax.__version__}"))
        except Exception as exc:
            skipped["JAX (linear)"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return cands, want


def torch_linear(q, k, v, cos, sin, chunk, eps):
    """Causal linear attention, chunked, in torch: (H, T, d) q, k and (H, T, dv) v; cos/sin (T, d/2).
    Features a = elu(q) + 1, b = elu(k) + 1; numerator with rotated a, b; denominator unrotated."""
    import torch

    H, T, d = q.shape
    dv = v.shape[-1]
    n = T // chunk
    a, b = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    h = d // 2

    def rot(x):
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    ar, br = rot(a).view(H, n, chunk, d), rot(b).view(H, n, chunk, d)
    a, b, vc = a.view(H, n, chunk, d), b.view(H, n, chunk, d), v.view(H, n, chunk, dv)
    mask = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    scores = (ar @ br.transpose(-1, -2)).masked_fill(~mask, 0.0)
    kv = br.transpose(-1, -2) @ vc                       # (H, n, d, dv) per chunk
    states = torch.cumsum(kv, dim=1) - kv                # exclusive: the state before each chunk
    num = scores @ vc + ar @ states
    bsum = b.sum(dim=2)                                  # (H, n, d)
    z = torch.cumsum(bsum, dim=1) - bsum
    den = (a * (torch.cumsum(b, dim=2) + z[:, :, None, :])).sum(-1, keepdim=True) + eps
    return (num / den).reshape(H, T, dv)


def jax_linear(chunk, eps):
    """The same chunked causal linear attention in JAX: jit + lax.scan over chunks carrying (S, z)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(q, k, v, cos, sin):
        H, T, d = q.shape
        dv = v.shape[-1]
        n, h = T // chunk, d // 2
        a, b = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1

        def rot(x):
            x1, x2 = x[..., :h], x[..., h:]
            return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

        def chunks(x):   # (H, T, e) -> (n, H, C, e)
            return jnp.swapaxes(x.reshape(H, n, chunk, x.shape[-1]), 0, 1)

        mask = jnp.tril(jnp.ones((chunk, chunk), bool))

        def step(carry, xs):
            S, z = carry
            ar, br, a_, b_, v_ = xs
            scores = jnp.where(mask, ar @ jnp.swapaxes(br, -1, -2), 0.0)
            num = scores @ v_ + ar @ S
            den = jnp.sum(a_ * (jnp.cumsum(b_, axis=1) + z[:, None, :]), axis=-1, keepdims=True) + eps
            return (S + jnp.swapaxes(br, -1, -2) @ v_, z + b_.sum(axis=1)), num / den

        init = (jnp.zeros((H, d, dv), q.dtype), jnp.zeros((H, d), q.dtype))
        _, out = jax.lax.scan(step, init, tuple(chunks(x) for x in (rot(a), rot(b), a, b, v)))
        return jnp.swapaxes(out, 0, 1).reshape(H, T, dv)

    return run


# -- the run -----------------------------------------------------------------------------------------
def run_case(label, cands, want, tol_of, rounds, round_s, skipped, rejected):
    """Check every contender, time the accepted ones interleaved; rows for the table and the JSON."""
    accepted, rows = [], {}
    for c in cands:
        ok, err = check(c, want, tol_of(c)) if c.checked else (True, None)   # copies compute nothing to compare
        if not ok:
            rejected[f"{label}: {c.name}"] = (f"error {err}" if isinstance(err, str) else
                                             f"relative error {err:.3g} > tolerance {tol_of(c):.3g}")
            continue
        accepted.append(c)
        rows[c.name] = dict(family=c.family, fp32_angles=c.fp32_angles, rel_error=err, tolerance=tol_of(c),
                            setup_s=c.setup_s, note=c.note)
    for name, (best, median, calls) in time_interleaved(accepted, rounds, round_s).items():
        rows[name].update(best_ms=best * 1e3, median_ms=median * 1e3, calls_per_round=calls)
    return rows


def main(args):
    t_start = time.perf_counter()
    quick = args.quick
    rounds = args.rounds or (3 if quick else 7)
    round_s = (args.round_ms or (25 if quick else 60)) / 1e3
    prefill_T = args.prefill_T or (1024 if quick else 4096)
    linear_T = args.linear_T or (2048 if quick else 8192)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    rng = np.random.default_rng(0)
    spec = rotary.RopeSpec(128, base=BASE)
    skipped, rejected, results = {}, {}, {}
    load_before = os.getloadavg()
    for case in cases:
        if case == "prefill":
            q = rng.standard_normal((1, prefill_T, 32, 128), dtype=np.float32)
            k = rng.standard_normal((1, prefill_T, 8, 128), dtype=np.float32)
            cands, want, max_pos = rope_case(case, q, k, np.arange(prefill_T, dtype=np.int64), spec, args, skipped,
                                             decode=False)
        elif case == "decode":
            q = rng.standard_normal((32, 1, 32, 128), dtype=np.float32)
            k = rng.standard_normal((32, 1, 8, 128), dtype=np.float32)
            cands, want, max_pos = rope_case(case, q, k, rng.integers(100, 8000, size=(32, 1)), spec, args, skipped,
                                             decode=True)
        elif case == "linear":
            cands, want = linear_case(linear_T, 8, 64, args, skipped, rng)
            max_pos = linear_T - 1
        else:
            raise SystemExit(f"unknown case {case!r}: prefill, decode or linear")
        if case == "linear":
            tol_of = (lambda c: TOL_LINEAR)
        else:
            tol_of = (lambda c, m=max_pos: tol_fp32_angles(m) if c.fp32_angles else TOL_EXACT)
        results[case] = run_case(case, cands, want, tol_of, rounds, round_s, skipped, rejected)
    meta = dict(threads=args.threads, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), quick=quick, rounds=rounds, round_ms=round_s * 1e3, prefill_T=prefill_T,
                linear_T=linear_T, numba_threads=__import__("numba").get_num_threads(),
                loadavg_before=load_before, loadavg_after=os.getloadavg(), cpu=_cpu_model(),
                logical_cores=os.cpu_count(), python=platform.python_version(), numpy=np.__version__,
                wall_s=time.perf_counter() - t_start,
                tolerances=dict(exact=TOL_EXACT, linear=TOL_LINEAR,
                                fp32_angles="TOL_EXACT + 2 * max_position * 2**-23"))
    return dict(meta=meta, cases=results, skipped=skipped, rejected=rejected)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SHAPES = {"prefill": "q (1, {T}, 32, 128), k (1, {T}, 8, 128), positions 0..{T1}",
          "decode": "q (32, 1, 32, 128), k (32, 1, 8, 128), one position in 100..8000 per sequence",
          "linear": "causal, H=8, T={T}, d=dv=64, elu, chunk 64"}


def report(res) -> str:
    meta, lines = res["meta"], []
    for case, rows in res["cases"].items():
        T = meta["prefill_T"] if case == "prefill" else meta["linear_T"]
        lines.append(f"\n{case}: {SHAPES[case].format(T=T, T1=T - 1)}, fp32, {meta['threads']} threads\n")
        ref = next((r["best_ms"] for n, r in rows.items() if n.startswith("rotary") and "best_ms" in r), None)
        compiled = next((r["best_ms"] for r in rows.values() if r["family"] == "compile" and "best_ms" in r), None)
        lines.append("| contender | best ms | median ms | x rotary | rel. error (tolerance) | fp32 angles | setup s |")
        lines.append("|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            if "best_ms" not in r:
                continue
            err = "-" if r["rel_error"] is None else f"{r['rel_error']:.1e} ({r['tolerance']:.0e})"
            setup = "" if r["setup_s"] is None else f"{r['setup_s']:.1f}"
            lines.append(f"| {name} | {r['best_ms']:.4g} | {r['median_ms']:.4g} | {r['best_ms'] / ref:.2f} | {err} | "
                         f"{'yes' if r['fp32_angles'] else 'no'} | {setup} |")
        if ref and compiled:
            lines.append(f"\nrotary ({next(iter(rows))}) vs torch.compile: {compiled / ref:.1f}x faster")
    if res["skipped"]:
        lines.append("\nskipped: " + "; ".join(f"{k}: {v}" for k, v in res["skipped"].items()))
    if res["rejected"]:
        lines.append("\nrejected (disagree with rotary, not timed): " +
                     "; ".join(f"{k}: {v}" for k, v in res["rejected"].items()))
    lines.append(f"\n{meta['cpu']}, {meta['logical_cores']} logical cores, OMP_WAIT_POLICY={meta['omp_wait_policy']}")
    lines.append(f"load average before {tuple(round(x, 2) for x in meta['loadavg_before'])}, after "
                 f"{tuple(round(x, 2) for x in meta['loadavg_after'])}; {meta['wall_s']:.0f} s")
    return "\n".join(lines)


def figure(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(c, {n: r for n, r in rows.items() if "best_ms" in r}) for c, rows in res["cases"].items()]
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 1.2 + 0.42 * sum(len(r) for _, r in cases)),
                             squeeze=False, gridspec_kw=dict(height_ratios=[max(1, len(r)) for _, r in cases]))
    colours = dict(rotary="tab:blue", hf="tab:orange", compile="tab:red", jax="tab:green", mlx="tab:purple",
                   numpy="tab:gray", copy="black")
    for ax, (case, rows) in zip(axes[:, 0], cases):
        names = list(rows)[::-1]
        vals = [rows[n]["best_ms"] for n in names]
        ax.barh(names, vals, color=[colours.get(rows[n]["family"], "tab:gray") for n in names])
        ax.set_xscale("log")
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
        ax.set_title(f"{case} (ms per call, best of {res['meta']['rounds']} interleaved rounds; lower is better)",
                     fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    res = main(ARGS)
    here = os.path.dirname(os.path.abspath(__file__))
    out = ARGS.out or os.path.join(here, "results", "peers.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=float)
    print(report(res))
    fig_path = ARGS.figure or os.path.splitext(out)[0] + ".png"
    if fig_path != "none":
        try:
            figure(res, fig_path)
            print(f"wrote {out} and {fig_path}")
        except ImportError as exc:
            print(f"wrote {out}; no figure ({exc}: pip install matplotlib)")
    else:
        print(f"wrote {out}")

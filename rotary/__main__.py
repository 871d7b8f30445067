"""Command line: ``python -m rotary info | demo | conformance | inspect | warm``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

from . import __version__

LLAMA31_8B = {  # the RoPE part of meta-llama/Llama-3.1-8B's config.json
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def _gpu_line() -> str:
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
        return f"{n} CUDA device(s): {', '.join(names)}"
    except Exception as exc:  # no cupy, no driver, no device
        return f"none usable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def cmd_info(args) -> int:
    import rotary

    print(f"rotary {rotary.__version__}  (python {platform.python_version()}, numpy {np.__version__})")
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores")
    print(f"GPU: {_gpu_line()}")
    print("backends:")
    for name, (ok, reason) in rotary.available_backends().items():
        print(f"  {name:6s} {'available' if ok else 'unavailable'}{'' if ok else ': ' + reason}")
    return 0


def _oracle(x, positions, spec):
    from .testing import rope_complex

    return rope_complex(x.astype(np.float64), positions, spec.inv_freq(int(positions.max()) + 1),
                        layout=spec.layout, scale=spec.attention_scaling)


def cmd_demo(args) -> int:
    import rotary
    from .conformance import cases as _conformance

    spec = rotary.RopeSpec.from_hf_config(LLAMA31_8B)
    print(f"spec from Llama-3.1-8B's config.json: {spec}")
    seq, hq, hk, d = args.tokens, 32, 8, spec.head_dim
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, seq, hq, d)).astype(np.float32)
    k = rng.standard_normal((1, seq, hk, d)).astype(np.float32)
    positions = np.arange(seq)
    ref_q = np.swapaxes(_oracle(np.swapaxes(q, 1, 2), positions, spec), 1, 2)
    ref_k = np.swapaxes(_oracle(np.swapaxes(k, 1, 2), positions, spec), 1, 2)
    print(f"\napply_qk on q {q.shape} and k {k.shape} (BSHD, float32), against the float64 oracle:")
    print(f"  {'backend':8s} {'max |error|':>12s} {'first call':>11s} {'per call':>10s}")
    failures = 0
    for name, (ok, reason) in rotary.available_backends().items():
        if not ok:
            print(f"  {name:8s} unavailable: {reason.split(';')[0]}")
            continue
        to_backend, to_host = _conformance.array_converters(name)
        to_backend = to_backend or (lambda a: a)
        to_host = to_host or np.asarray
        qb, kb = to_backend(q), to_backend(k)
        t0 = time.perf_counter()
        qr, kr = rotary.apply_qk(qb, kb, spec=spec, seq_axis=-3, backend=name)
        to_host(qr)
        first = time.perf_counter() - t0
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            qr, kr = rotary.apply_qk(qb, kb, spec=spec, seq_axis=-3, backend=name)
        to_host(kr)
        per = (time.perf_counter() - t0) / reps
        err = max(np.abs(to_host(qr) - ref_q).max(), np.abs(to_host(kr) - ref_k).max())
        failures += err > 1e-5
        print(f"  {name:8s} {err:12.2e} {first * 1e3:9.1f}ms {per * 1e3:8.2f}ms")

    print("\nprecision at large positions (one head of d=128, base 5e5), max |error| of the rotated vector:")
    print(f"  {'position':>12s} {'rotary fp32':>12s} {'HF-style fp32 angles':>21s}")
    x = rng.standard_normal((1, d)).astype(np.float32)
    plain = rotary.RopeSpec(d, base=500000.0)
    inv32 = (1.0 / (np.float32(500000.0) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(np.float32)
    for p in (4096, 131072, 1_000_000, 2**31 - 1):
        pos = np.array([p])
        exact = _oracle(x, pos, plain)
        ours = rotary.apply(x, pos, spec=plain)
        theta32 = (np.float32(p) * inv32).astype(np.float32)      # HF: inv_freq @ position_ids in fp32
        c, s = np.cos(theta32), np.sin(theta32)
        hf = np.concatenate([x[:, :64] * c - x[:, 64:] * s, x[:, 64:] * c + x[:, :64] * s], axis=-1)
        print(f"  {p:12d} {np.abs(ours - exact).max():12.2e} {np.abs(hf - exact).max():21.2e}")
    failures += _demo_linear_attention(seq, rng)
    print("\nall backends agree with the float64 oracle" if not failures else f"\n{failures} backend(s) FAILED")
    return 1 if failures else 0


def _demo_linear_attention(seq, rng) -> int:
    """Causal linear attention with RoPE per backend against the quadratic float64 oracle, one call and
    prefill + continue through the state; returns the number of failing backends."""
    import rotary
    from .conformance import cases as _conformance
    from . import backends
    from .testing import linear_attention_quadratic

    spec = rotary.RopeSpec(64)
    q, k, v = (rng.standard_normal((1, 8, seq, 64)).astype(np.float32) for _ in range(3))
    ref = linear_attention_quadratic(q, k, v, np.arange(seq), spec.inv_freq(), causal=True)
    rms = np.sqrt(np.mean(ref**2))
    cut = seq // 2
    print(f"\ncausal linear attention with RoPE (RoFormer eq. 19) on q, k, v {q.shape} (BHSD, float32), "
          "max |error| / rms(o) against the quadratic float64 oracle:")
    print(f"  {'backend':8s} {'one call':>12s} {'prefill+resume':>15s} {'first call':>11s} {'per call':>10s}")
    failures = 0
    for name, (ok, reason) in rotary.available_backends().items():
        if not ok or not hasattr(backends.get(name), "linear_attention"):
            print(f"  {name:8s} unavailable: {reason.split(';')[0]}")
            continue
        to_backend, to_host = _conformance.array_converters(name)
        to_backend = to_backend or (lambda a: a)
        to_host = to_host or np.asarray
        qb, kb, vb = (to_backend(a) for a in (q, k, v))
        t0 = time.perf_counter()
        o = to_host(rotary.linear_attention(qb, kb, vb, causal=True, spec=spec, layout="bhsd", backend=name))
        first = time.perf_counter() - t0
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            o = rotary.linear_attention(qb, kb, vb, causal=True, spec=spec, layout="bhsd", backend=name)
        o = to_host(o)
        per = (time.perf_counter() - t0) / reps
        o1, state = rotary.linear_attention(qb[:, :, :cut], kb[:, :, :cut], vb[:, :, :cut], causal=True, spec=spec,
                                            layout="bhsd", return_state=True, backend=name)
        o2 = rotary.linear_attention(qb[:, :, cut:], kb[:, :, cut:], vb[:, :, cut:], causal=True, state=state,
                                     layout="bhsd", backend=name)
        resumed = np.concatenate([to_host(o1), to_host(o2)], axis=2)
        err, err_resumed = (float(np.abs(a - ref).max() / rms) for a in (o, resumed))
        failures += max(err, err_resumed) > _conformance.LINEAR_TOLERANCES["float32"]
        compiles = getattr(backends.get(name), "COMPILES_ON_FIRST_CALL", False)
        note = "  (includes the JIT compile; cached on disk after)" if compiles and first > 1 else ""
        print(f"  {name:8s} {err:12.2e} {err_resumed:15.2e} {first * 1e3:9.1f}ms {per * 1e3:8.2f}ms{note}")
    return failures


EPILOG = """examples:
  python -m rotary info                       # version, backends and why any is unavailable
  python -m rotary demo                       # every backend against the float64 oracle (Numba compiles once)
  python -m rotary conformance --quick        # the cross-backend conformance suite, a representative subset
  python -m rotary inspect config.json        # the RoPE spec rotary reads from an HF config.json
  python -m rotary warm                       # compile every Numba kernel into the on-disk cache ahead of use
  python -m rotary VERB --help                # one verb's options and an example"""

INFO_EPILOG = """example:
  python -m rotary info
  python -m rotary info | head -3             # version, CPU, GPU lines only"""

DEMO_EPILOG = """examples:
  python -m rotary demo                       # 512 tokens; the first run compiles the Numba kernels (cached on disk)
  python -m rotary demo --tokens 64           # a shorter run"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m rotary`` with every verb registered (each verb's ``--help`` ends with
    examples)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m rotary", description="Rotary Position Embedding toolkit",
                                     epilog=EPILOG, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"rotary {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="VERB")
    p = sub.add_parser("info", help="version, backends (and why unavailable), CPU/GPU found",
                       description="Print the version, the backends (and why any is unavailable), CPU and GPU.",
                       epilog=INFO_EPILOG, formatter_class=fmt)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("demo", help="a Llama-3.1-8B RoPE run through every available backend, errors and timings",
                       description="Run a Llama-3.1-8B RoPE and causal linear attention with RoPE through every "
                                   "available backend; print each one's error against the float64 oracle and its "
                                   "time. Exit status 1 if any backend disagrees.",
                       epilog=DEMO_EPILOG, formatter_class=fmt)
    p.add_argument("--tokens", type=_positive_int, default=512, help="sequence length >= 1 (default 512)")
    p.set_defaults(func=cmd_demo)
    _add_optional_commands(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:     # ``python -m rotary`` alone: the help, not an error
        parser.print_help()
        return 0
    return args.func(args)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _run(argv=None) -> int:
    """main(), quiet when stdout is closed early (``python -m rotary info | head -2``)."""
    try:
        status = main(argv)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)   # the reader left: drop the rest, exit quietly
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _add_optional_commands(sub) -> None:
    """Subcommands that live in their own modules (conformance runner, benchmarks)."""
    try:
        from .cli import conformance as _cli_conformance
    except ImportError:
        return
    _cli_conformance.add_parser(sub)
    from .cli import inspect as _cli_inspect

    _cli_inspect.add_parser(sub)
    from .cli import warm as _cli_warm

    _cli_warm.add_parser(sub)


if __name__ == "__main__":
    sys.exit(_run())

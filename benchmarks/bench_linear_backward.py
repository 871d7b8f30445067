"""Training speed of causal linear attention with RoPE (issue 45): rotary's forward and backward kernels beside
torch autograd and JAX's grad of chunked forms, and a torch.compile'd training step against its eager step.

    PYTHONPATH=. python benchmarks/bench_linear_backward.py            # H=8, T=8192, d=dv=64, fp32: minutes
    PYTHONPATH=. python benchmarks/bench_linear_backward.py --quick    # T=2048, 3 rounds, a smaller model: a smoke run

Case: q, k, v (1, T, H, d) float32 BSHD, elu + 1 features, RoPE in the numerator (half pairs, base 10000),
causal, chunk 64, grad_o a random (1, T, H, dv). Rows (every one checked against rotary's results first):

- **rotary (Numba)**: ``rotary.linear_attention`` (forward), ``linear_attention_backward`` (backward, from the
  forward's inputs and grad_o), and the two one after the other (forward + backward); and the same with the
  forward keeping its states before each chunk (``save_for_backward=True``, "states-kept") and the backward
  reading them (``saved=``) instead of sweeping k and v again (the gradients checked equal, bit for bit);
- **torch autograd, chunked**: the chunked torch form of ``bench_peers.py`` (eager), its forward, and
  ``torch.autograd.grad`` of ``sum(o * grad_o)`` (forward + backward; backward = the difference);
- **torch.compile forward**: that chunked form under ``torch.compile`` (inductor, static shapes; its compile time
  reported apart), the issue's "rotary's forward >= 2x faster than a chunked form under torch.compile";
- **JAX grad, lax.scan**: the ``jit`` + ``lax.scan`` form of ``bench_peers.py``, its forward and a jitted
  ``jax.vjp`` (forward + backward);
- **sgemm**: ``np.dot`` of two 2048 x 2048 float32 matrices in the same run, the machine's own limit. Work of the
  forward ``4 T d (C + d) H`` flops (bench_numba.py's count: every chunk product at full size), of the backward
  ``10 T d (C + d) H`` (ten chunk products: W, P^T, dÂ's two, dB̂'s two, dV's two, P's chunk term and the forward
  sweep's state);
- **training step**: a 2-layer linear-attention model (token embedding-free: x (1, T, H d), per layer q, k, v
  projections, ``rotary.linear_attention``, an output projection and a residual; a linear read-out and a mean
  squared loss), one SGD step: eager (the custom op through eager autograd) against ``torch.compile`` of the
  whole step (its compile time reported apart).

Peak memory: each measured in a fresh process (the growth of the peak resident set across the call, the peak reset
just before it through /proc/self/clear_refs; inputs and grad_o already allocated, kernels loaded and JAX's
programs compiled before): ``extra`` is what the call adds; ``with inputs`` adds q, k, v (the forward's working set: the issue's "peak memory of a forward + backward
<= 2x the forward's" reads the second column).

Timing: one warm-up call each, then ``--rounds`` rounds timing every contender in turn (calls per round sized to
~``--round-ms``), best per-call time of the rounds and the median. ``--threads`` (default 2) for BLAS, OpenMP,
Numba and torch, set before they are imported (``OMP_WAIT_POLICY=PASSIVE`` unless set). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

THREADS_DEFAULT = 2
HERE = os.path.dirname(os.path.abspath(__file__))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="T=2048, 3 rounds of 25 ms, a smaller training step")
    p.add_argument("--threads", type=int, default=THREADS_DEFAULT, help="threads per implementation (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; quick 3)")
    p.add_argument("--round-ms", type=float, default=None, help="time per contender per round (default 150; quick 25)")
    p.add_argument("--T", type=int, default=None, help="tokens (default 8192; quick 2048)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: torch, jax, compile, memory")
    p.add_argument("--steady", action="store_true",
                   help="only rotary's four calls (forward, backward, both with kept states), each repeated alone")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)   # internal: one peak-memory measurement
    return p.parse_args(argv)


def _set_threads(n: int) -> None:
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


if __name__ == "__main__":
    ARGS = _parse(sys.argv[1:])
    _set_threads(ARGS.threads)

import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import rotary  # noqa: E402
from rotary.attn.linear_backward import linear_attention_backward  # noqa: E402

sys.path.insert(0, HERE)
from bench_peers import exact_tables, jax_linear, torch_linear  # noqa: E402

H, D, CHUNK, EPS, BASE = 8, 64, 64, 1e-6, 10000.0
SGEMM_N = 2048


# -- inputs and the contenders ----------------------------------------------------------------------------------
def inputs(T, seed=0):
    """q, k, v, grad_o (1, T, H, D) float32 and the spec."""
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((1, T, H, D), dtype=np.float32) * 0.5 for _ in range(4))
    return q, k, v, g, rotary.RopeSpec(D, base=BASE)


def rotary_calls(q, k, v, g, spec):
    kw = dict(causal=True, feature_map="elu", spec=spec, seq_axis=1, backend="numba", chunk=CHUNK, eps=EPS)

    def forward():
        return rotary.linear_attention(q, k, v, **kw)

    def backward():
        return linear_attention_backward(q, k, v, g, **kw)[:3]

    def both():
        return forward(), backward()
    return forward, backward, both


def rotary_kept_calls(q, k, v, g, spec):
    """The same with the forward keeping its chunk states (``save_for_backward=True``) and the backward reading them
    (``saved=``): (forward, backward of one kept forward's states, forward + backward)."""
    kw = dict(causal=True, feature_map="elu", spec=spec, seq_axis=1, backend="numba", chunk=CHUNK, eps=EPS)
    saved = rotary.linear_attention(q, k, v, save_for_backward=True, **kw)[1]
    assert saved is not None

    def forward():
        return rotary.linear_attention(q, k, v, save_for_backward=True, **kw)

    def backward():
        return linear_attention_backward(q, k, v, g, saved=saved, **kw)[:3]

    def both():
        o, kept = forward()
        return o, linear_attention_backward(q, k, v, g, saved=kept, **kw)[:3]
    return forward, backward, both


def heads_first(*arrays):
    return [np.ascontiguousarray(np.swapaxes(a[0], 0, 1)) for a in arrays]   # (H, T, d), the peers' layout


def to_bshd(x):
    return np.swapaxes(np.asarray(x), 0, 1)[None]


def torch_calls(q, k, v, g, spec, threads):
    import torch

    torch.set_num_threads(threads)
    T = q.shape[1]
    cos_t, sin_t = (torch.from_numpy(t.copy()) for t in exact_tables(spec, T - 1))
    tq, tk, tv, tg = (torch.from_numpy(a) for a in heads_first(q, k, v, g))
    leaves = [x.clone().requires_grad_() for x in (tq, tk, tv)]

    def forward():
        with torch.no_grad():
            return torch_linear(tq, tk, tv, cos_t, sin_t, CHUNK, EPS)

    def both():
        o = torch_linear(*leaves, cos_t, sin_t, CHUNK, EPS)
        return o.detach(), torch.autograd.grad(o, leaves, tg)
    return forward, both


def torch_compiled_forward(q, k, v, spec, threads):
    """(forward, compile seconds): bench_peers.py's chunked torch form under ``torch.compile`` (inductor, static
    shapes, no grad), compiled here (not in the timings)."""
    import torch

    torch.set_num_threads(threads)
    T = q.shape[1]
    cos_t, sin_t = (torch.from_numpy(t.copy()) for t in exact_tables(spec, T - 1))
    tq, tk, tv = (torch.from_numpy(a) for a in heads_first(q, k, v))
    compiled = torch.compile(torch_linear, dynamic=False)

    def forward():
        with torch.no_grad():
            return compiled(tq, tk, tv, cos_t, sin_t, CHUNK, EPS)

    t0 = time.perf_counter()
    forward()
    return forward, time.perf_counter() - t0


def jax_calls(q, k, v, g, spec):
    import jax

    T = q.shape[1]
    run = jax_linear(CHUNK, EPS)
    cos_t, sin_t = exact_tables(spec, T - 1)
    args = [jax.numpy.asarray(a) for a in (*heads_first(q, k, v), cos_t, sin_t)]
    jg = jax.numpy.asarray(heads_first(g)[0])

    def vjp(q_, k_, v_, cos_, sin_, g_):
        o, pull = jax.vjp(lambda a, b, c: run(a, b, c, cos_, sin_), q_, k_, v_)
        return o, pull(g_)

    fwd = jax.jit(run).lower(*args).compile()                # compiled here: not in the timings or the memory
    both = jax.jit(vjp).lower(*args, jg).compile()
    return (lambda: jax.block_until_ready(fwd(*args))), (lambda: jax.block_until_ready(both(*args, jg)))


# -- timing -----------------------------------------------------------------------------------------------------
def time_interleaved(calls, rounds, round_s):
    """{name: (best, median) seconds per call}; every call once per round, calls per round sized to round_s."""
    reps = {}
    for name, fn in calls.items():
        t = time.perf_counter()
        fn()
        reps[name] = max(1, min(1000, int(round_s / max(time.perf_counter() - t, 1e-7))))
    per = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            per[name].append((time.perf_counter() - t) / reps[name])
    return {name: (min(ts), statistics.median(ts)) for name, ts in per.items()}


def rel_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def sgemm_gflops(rounds):
    a = np.random.default_rng(3).standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
    c = np.empty_like(a)
    best = time_interleaved({"sgemm": lambda: np.dot(a, a, out=c)}, rounds, 0.1)["sgemm"][0]
    return 2 * SGEMM_N ** 3 / best / 1e9


# -- the training step ------------------------------------------------------------------------------------------
def training_step(T, width_heads, layers, threads):
    """(eager step, compiled step, compile seconds) of a ``layers``-layer linear-attention model on x (1, T, H d)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    Hh = width_heads
    width = Hh * D
    spec = rotary.RopeSpec(D, base=BASE)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
            self.out = torch.nn.Linear(width, width, bias=False)

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(1, T, 3, Hh, D).unbind(2)
            o = rotary.linear_attention(q, k, v, causal=True, spec=spec, seq_axis=1, chunk=CHUNK)
            return x + self.out(o.reshape(1, T, width))

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[Block() for _ in range(layers)], torch.nn.Linear(width, width, bias=False))
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    x = torch.randn(1, T, width) * 0.5
    y = torch.randn(1, T, width)
    eager_model, eager_opt = make()
    compiled_model, compiled_opt = make()

    def step_of(model, opt):
        def step():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    eager = step_of(eager_model, eager_opt)
    compiled_fwd = torch.compile(compiled_model, fullgraph=True)
    compiled = step_of(compiled_fwd, compiled_opt)
    t0 = time.perf_counter()
    compiled()
    compile_s = time.perf_counter() - t0
    eager()
    return eager, compiled, compile_s


# -- peak memory in fresh processes -----------------------------------------------------------------------------
MEMORY_CASES = ("rotary forward", "rotary forward + backward", "rotary states-kept forward",
                "rotary states-kept forward + backward", "torch forward", "torch forward + backward", "JAX forward",
                "JAX forward + backward")


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def measure_memory(name, T, threads):
    """Peak RSS growth (MiB) of one call of ``name`` in this process (inputs made and kernels loaded first): the
    process's peak (VmHWM) reset through /proc/self/clear_refs (Linux >= 4.0) just before the call, minus the
    resident size then; where that cannot be reset, the growth of ru_maxrss (a lower bound)."""
    q, k, v, g, spec = inputs(T)
    if name.startswith("rotary"):
        small = [a[:, :CHUNK * 2].copy() for a in (q, k, v, g)]
        make = rotary_kept_calls if "states-kept" in name else rotary_calls
        for fn in make(*small, spec)[2:]:
            fn()                                   # the kernels loaded (from Numba's cache) at a small size
        fwd, _, both = make(q, k, v, g, spec)
    elif name.startswith("torch"):
        small = [a[:, :CHUNK * 2].copy() for a in (q, k, v, g)]
        torch_calls(*small, spec, threads)[1]()
        fwd, both = torch_calls(q, k, v, g, spec, threads)
    else:
        fwd, both = jax_calls(q, k, v, g, spec)    # compiled at T before the baseline
    call = both if name.endswith("backward") else fwd
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                           # resets the peak resident set size to the current one
        before = _status_kib("VmRSS")
        result = call()
        after = _status_kib("VmHWM")
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = call()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    return (after - before) / 1024.0             # KiB


def memory_rows(T, threads):
    out = {}
    for name in MEMORY_CASES:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-of", name, "--T", str(T),
               "--threads", str(threads)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE),
                                                                                os.environ.get("PYTHONPATH", "")])))
        lines = [line for line in run.stdout.split("\n") if line.startswith("MEMORY ")]
        out[name] = float(lines[-1].split()[1]) if run.returncode == 0 and lines else None
        if out[name] is None:
            print(f"memory of {name}: failed: {(run.stderr or run.stdout).strip().splitlines()[-1:]}",
                  file=sys.stderr)
    return out


# -- the run ----------------------------------------------------------------------------------------------------
def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def steady(T, calls=15, rounds=2):
    """rotary's forward, backward, the forward keeping its states and the backward through them, each called
    ``calls`` times in a row (no other contender between: the allocator settles), ``rounds`` rounds; prints each
    round's median and the last round's ratios."""
    q, k, v, g, spec = inputs(T)
    fwd, bwd, _ = rotary_calls(q, k, v, g, spec)
    k_fwd, k_bwd, _ = rotary_kept_calls(q, k, v, g, spec)
    named = {"forward": fwd, "backward": bwd, "forward keeping its states": k_fwd,
             "backward through the kept states": k_bwd}
    for r in range(rounds):
        med = {}
        for name, fn in named.items():
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            med[name] = float(np.median(ts))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in med.items()))
    f = med["forward"]
    print(f"backward / forward {med['backward'] / f:.2f}; backward through the kept states / forward "
          f"{med['backward through the kept states'] / f:.2f} (T={T}, {calls} calls each, medians)")


def main(args):
    T = args.T or (2048 if args.quick else 8192)
    if getattr(args, "steady", False):
        return steady(T)
    rounds = args.rounds or (3 if args.quick else 7)
    round_s = (args.round_ms or (25 if args.quick else 150)) / 1e3
    skip = set(filter(None, args.skip.split(",")))
    q, k, v, g, spec = inputs(T)
    fwd, bwd, both = rotary_calls(q, k, v, g, spec)
    want_o, want_grads = both()
    calls = {"rotary forward": fwd, "rotary backward": bwd, "rotary forward + backward": both}
    k_fwd, k_bwd, k_both = rotary_kept_calls(q, k, v, g, spec)
    kept_o, kept_grads = k_both()
    assert np.array_equal(kept_o, want_o) and all(np.array_equal(a, b) for a, b in zip(kept_grads, want_grads))
    calls.update({"rotary states-kept forward": k_fwd, "rotary states-kept backward": k_bwd,
                  "rotary states-kept forward + backward": k_both})
    notes, skipped = [], {}
    if "torch" not in skip:
        try:
            import torch
            t_fwd, t_both = torch_calls(q, k, v, g, spec, args.threads)
            o, grads = t_both()
            errs = [rel_error(to_bshd(o.numpy()), want_o)] + [rel_error(to_bshd(x.numpy()), w)
                                                              for x, w in zip(grads, want_grads)]
            notes.append(f"torch chunked vs rotary: o, dq, dk, dv relative errors {', '.join(f'{e:.1e}' for e in errs)}")
            calls.update({"torch forward": t_fwd, "torch forward + backward": t_both})
            notes.append(f"torch {torch.__version__}")
        except Exception as exc:
            skipped["torch"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if "compile" not in skip and "torch" not in skipped:
            try:
                c_fwd, compile_s = torch_compiled_forward(q, k, v, spec, args.threads)
                notes.append(f"torch.compile chunked vs rotary: o relative error "
                             f"{rel_error(to_bshd(c_fwd().numpy()), want_o):.1e}; compiled in {compile_s:.1f} s "
                             "(not in the timings)")
                calls["torch.compile forward"] = c_fwd
            except Exception as exc:
                skipped["torch.compile forward"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if "jax" not in skip:
        try:
            import jax
            j_fwd, j_both = jax_calls(q, k, v, g, spec)
            o, grads = j_both()
            errs = [rel_error(to_bshd(o), want_o)] + [rel_error(to_bshd(x), w) for x, w in zip(grads, want_grads)]
            notes.append(f"JAX lax.scan vs rotary: o, dq, dk, dv relative errors {', '.join(f'{e:.1e}' for e in errs)}")
            calls.update({"JAX forward": j_fwd, "JAX forward + backward": lambda: j_both()})
            notes.append(f"jax {jax.__version__}")
        except Exception as exc:
            skipped["jax"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    step_rows = {}
    if "compile" not in skip and "torch" not in skip:
        try:
            heads, layers = (4, 2) if args.quick else (H, 2)
            eager, compiled, compile_s = training_step(T, heads, layers, args.threads)
            step_rows = {"training step, eager": eager, "training step, torch.compile": compiled}
            calls.update(step_rows)
            notes.append(f"training step: 2 layers, {heads} heads of {D}, T={T}; torch.compile took {compile_s:.1f} s "
                         "(not in the timings)")
        except Exception as exc:
            skipped["training step"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    load_before = os.getloadavg()
    sgemm = sgemm_gflops(rounds)
    times = time_interleaved(calls, rounds, round_s)
    sgemm_after = sgemm_gflops(rounds)
    memory = {} if "memory" in skip else memory_rows(T, args.threads)

    flops_f, flops_b = 4 * T * D * (CHUNK + D) * H, 10 * T * D * (CHUNK + D) * H
    inputs_mib = 3 * q.nbytes / 2 ** 20
    derived = {}
    for lib in ("rotary", "torch", "JAX"):
        f, fb = times.get(f"{lib} forward"), times.get(f"{lib} forward + backward")
        if f and fb and f"{lib} backward" not in times:
            derived[f"{lib} backward"] = (fb[0] - f[0], fb[1] - f[1])
    all_times = dict(times, **derived)
    f0 = times["rotary forward"][0]
    rows = []
    for name, (best, med) in all_times.items():
        if name.startswith("training step"):
            continue
        flop = flops_f + flops_b if name.endswith("forward + backward") else flops_f if name.endswith("forward") \
            else flops_b
        mem = memory.get(name)
        mem_s = "" if mem is None else f"{mem:.0f} / {mem + inputs_mib:.0f}"
        rows.append((name + (" (difference)" if name in derived else ""), f"{best * 1e3:.1f}", f"{med * 1e3:.1f}",
                     f"{best / f0:.2f}", f"{flop / best / 1e9:.0f}", f"{flop / best / 1e9 / sgemm:.2f}", mem_s))
    print(f"Causal linear attention with RoPE, H={H}, T={T}, d=dv={D}, C={CHUNK}, fp32, {args.threads} threads; "
          f"{_cpu_model()}; load average {load_before[0]:.2f} before; sgemm {sgemm:.0f} / {sgemm_after:.0f} GFLOP/s "
          f"(before / after)\n")
    print(table(["what", "best ms", "median ms", "x rotary forward", "GFLOP/s", "x sgemm",
                 "peak MiB: extra / with inputs"], rows))
    if step_rows:
        e, c = times["training step, eager"], times["training step, torch.compile"]
        print()
        print(table(["training step", "best ms", "median ms", "x eager"],
                    [("eager", f"{e[0] * 1e3:.1f}", f"{e[1] * 1e3:.1f}", "1.00"),
                     ("torch.compile", f"{c[0] * 1e3:.1f}", f"{c[1] * 1e3:.1f}", f"{c[0] / e[0]:.2f}")]))
    rb = all_times.get("rotary backward")
    print(f"\nrotary backward / forward: {rb[0] / f0:.2f} (best), {rb[1] / times['rotary forward'][1]:.2f} (median)"
          " (bound: <= 2.5)")
    kb, kf = all_times.get("rotary states-kept backward"), times.get("rotary states-kept forward")
    if kb and kf:
        print(f"rotary backward through the forward's kept states / forward: {kb[0] / f0:.2f} (best), "
              f"{kb[1] / times['rotary forward'][1]:.2f} (median) (bound: <= 2.5); / the forward that keeps them: "
              f"{kb[0] / kf[0]:.2f} (best), {kb[1] / kf[1]:.2f} (median)")
        kfb, fb = times["rotary states-kept forward + backward"], times["rotary forward + backward"]
        print(f"rotary forward + backward with kept states / without: {kfb[0] / fb[0]:.2f} (best), "
              f"{kfb[1] / fb[1]:.2f} (median)")
    print(f"rotary forward / sgemm rate: {flops_f / f0 / 1e9 / sgemm:.2f} (bound: >= 0.7)")
    tc = times.get("torch.compile forward")
    if tc:
        print(f"torch.compile chunked forward / rotary forward: {tc[0] / f0:.2f}x (best), "
              f"{tc[1] / times['rotary forward'][1]:.2f}x (median) (bound: rotary >= 2x faster)")
    for kind in ("", "states-kept "):
        m1, m2 = memory.get(f"rotary {kind}forward"), memory.get(f"rotary {kind}forward + backward")
        if m1 and m2:
            print(f"rotary {kind}peak memory, forward + backward / forward: {m2 / m1:.2f} (extra), "
                  f"{(m2 + inputs_mib) / (m1 + inputs_mib):.2f} (with inputs)")
    m0, m2 = memory.get("rotary forward"), memory.get("rotary states-kept forward + backward")
    if m0 and m2:
        print(f"rotary states-kept forward + backward / the plain forward, peak memory: {m2 / m0:.2f} (extra), "
              f"{(m2 + inputs_mib) / (m0 + inputs_mib):.2f} (with inputs)")
    for note in notes:
        print(f"- {note}")
    for what, why in skipped.items():
        print(f"- skipped {what}: {why}")
    return {"T": T, "times": {k: list(v) for k, v in all_times.items()}, "memory": memory, "sgemm": [sgemm, sgemm_after]}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    if ARGS.memory_of:
        print(f"MEMORY {measure_memory(ARGS.memory_of, ARGS.T, ARGS.threads):.3f}")
    else:
        result = main(ARGS)
        if os.environ.get("BENCH_JSON"):
            with open(os.environ["BENCH_JSON"], "w") as f:
                json.dump(result, f, indent=1)

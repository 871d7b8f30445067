"""Interop benchmarks: torch CPU tensors against NumPy arrays on the same backend, and Dask.

    python benchmarks/bench_interop.py torch [--threads 2]
    python benchmarks/bench_interop.py dask [--tokens 1048576 --chunks 16 --workers 2]

torch: apply_qk at the Llama-3-8B prefill shape (q (1, 4096, 32, 128), k (1, 4096, 8, 128) fp32) and
a decode call (q (32, 1, 32, 128), k (32, 1, 8, 128), one position per sequence), the same memory as
torch tensors (``Tensor.numpy()`` views) and as NumPy arrays, best of interleaved repetitions; the
ratio torch / NumPy is what the adapter costs (target: <= 1.2 prefill, <= 1.5 decode).

dask: causal linear attention over T tokens (1, T, 2, 32) fp32 in ``--chunks`` sequence chunks on a
LocalCluster of ``--workers`` single-threaded worker processes (inputs generated and persisted on the
workers; the output persisted there, so no transfer is timed) against one in-process Numba call with
``--workers`` threads; prints tokens/s of both and the task-graph size.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time


def _best(fn, reps, min_time=1.0):
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * reps:
            break
    return min(times)


def bench_torch(args):
    import numpy as np
    import torch

    import rotary

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    cases = {
        "prefill (1,4096,32,128)/(1,4096,8,128)": (
            rng.standard_normal((1, 4096, 32, 128), dtype=np.float32),
            rng.standard_normal((1, 4096, 8, 128), dtype=np.float32), None),
        "decode (32,1,32,128)/(32,1,8,128)": (
            rng.standard_normal((32, 1, 32, 128), dtype=np.float32),
            rng.standard_normal((32, 1, 8, 128), dtype=np.float32), rng.integers(100, 8000, size=(32, 1))),
    }
    rows = []
    for name, (q, k, pos) in cases.items():
        tq, tk = torch.from_numpy(q), torch.from_numpy(k)
        tpos = None if pos is None else torch.from_numpy(pos)
        for backend in ("numba", "numpy"):
            reps = 5 if pos is None else 200
            best_np, best_t = [], []
            for _ in range(3):   # interleaved
                best_np.append(_best(lambda: rotary.apply_qk(q, k, pos, seq_axis=-3, backend=backend), reps))
                best_t.append(_best(lambda: rotary.apply_qk(tq, tk, tpos, seq_axis=-3, backend=backend), reps))
            t_np, t_t = min(best_np), min(best_t)
            rows.append({"case": name, "backend": backend, "numpy_s": t_np, "torch_s": t_t, "ratio": t_t / t_np})
            print(f"{name:40s} {backend:6s} numpy {t_np * 1e3:9.3f} ms  torch {t_t * 1e3:9.3f} ms  "
                  f"torch/numpy {t_t / t_np:5.2f}", flush=True)
    return rows


def bench_dask(args):
    import dask.array as da
    import numpy as np
    from distributed import Client, LocalCluster, wait

    import rotary

    T, n = args.tokens, args.chunks
    shape = (1, T, 2, 32)
    chunks = (1, T // n, 2, 32)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
    rotary.linear_attention(*(a[:, :256] for a in host), causal=True, seq_axis=-3, backend="numba")
    t_single = _best(lambda: rotary.linear_attention(*host, causal=True, seq_axis=-3, backend="numba"), 2,
                     min_time=0)
    host.clear()   # free the host copies before the cluster starts
    result = {"tokens": T, "chunks": n, "shape": shape, "single_process_numba_s": t_single}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        arrays = [da.random.default_rng(seed).standard_normal(shape, chunks=chunks, dtype=np.float32)
                  for seed in range(3)]
        arrays = client.persist(arrays)
        wait(arrays)
        dq, dk, dv = arrays
        o = rotary.linear_attention(dq, dk, dv, causal=True, seq_axis=-3, backend="numba")
        lazy = [da.zeros(shape, chunks=chunks, dtype=np.float32) for _ in range(3)]
        graph = dict(rotary.linear_attention(*lazy, causal=True, seq_axis=-3, backend="numba").__dask_graph__())
        names = collections.Counter((key[0] if isinstance(key, tuple) else key).rsplit("-", 1)[0] for key in graph)
        result["graph_tasks"] = len(graph)   # including the 3 x chunks input tasks
        result["graph_tasks_by_kind"] = dict(names)
        warm = rotary.linear_attention(dq[:, : 2 * (T // n)], dk[:, : 2 * (T // n)], dv[:, : 2 * (T // n)],
                                       causal=True, seq_axis=-3, backend="numba")
        client.compute(warm, sync=True)   # compile the kernels on every worker
        client.run(lambda: rotary.linear_attention(*(np.zeros((1, 8, 2, 32), np.float32),) * 3, causal=True,
                                                   seq_axis=-3, backend="numba"))
        times = []
        for _ in range(2):
            o = rotary.linear_attention(dq, dk, dv, causal=True, seq_axis=-3, backend="numba")
            t0 = time.perf_counter()
            p = client.persist(o)
            wait(p)
            times.append(time.perf_counter() - t0)
            del p
        result["cluster_s"] = min(times)
    result["single_tokens_per_s"] = T / t_single
    result["cluster_tokens_per_s"] = T / result["cluster_s"]
    result["cluster_over_single"] = result["cluster_tokens_per_s"] / result["single_tokens_per_s"]
    print(json.dumps(result, indent=1))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["torch", "dask"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads if args.what == "torch" else args.workers))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    (bench_torch if args.what == "torch" else bench_dask)(args)


if __name__ == "__main__":
    main()

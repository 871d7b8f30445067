#!/usr/bin/env bash
# A/B of whole checkouts, interleaved round by round: bench_rope.py x3, bench_numba.py x2, import time x10.
#   git worktree add --detach /tmp/before <rev>; bash benchmarks/ab_checkouts.sh OUT_DIR /tmp/before .
# Each checkout runs with PYTHONPATH=<checkout> so its own rotary is imported; results go to OUT_DIR.
set -u
out=$1; shift
mkdir -p "$out"
run() {  # run <checkout> <file> <command...>
  local tree=$1 file=$2; shift 2
  (cd "$tree" && PYTHONPATH="$(pwd)" "$@") >> "$out/$file" 2>&1
}
name() { basename "$(cd "$1" && pwd)"; }
for tree in "$@"; do   # warm each checkout's Numba cache first
  run "$tree" "warm_$(name "$tree").txt" python benchmarks/bench_rope.py --rounds 1 --calls 10
done
for i in 1 2 3; do for tree in "$@"; do
  run "$tree" "rope_$(name "$tree")_$i.txt" python benchmarks/bench_rope.py
done; done
for i in 1 2; do for tree in "$@"; do
  run "$tree" "numba_$(name "$tree")_$i.txt" python benchmarks/bench_numba.py --rounds 5 --lengths 4096 16384
done; done
for i in $(seq 10); do for tree in "$@"; do
  (cd "$tree" && PYTHONPATH="$(pwd)" python -X importtime -c "import rotary" 2>&1 | tail -1) >> "$out/import_$(name "$tree").txt"
done; done
echo "results in $out"

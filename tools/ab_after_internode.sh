#!/usr/bin/env bash
# AFTER_CMD for tools/gpu_ab.sh when the A/B changes the internode path (session 11, call 2):
#   AFTER_CMD="bash tools/ab_after_internode.sh" bash tools/gpu_ab.sh
# Runs in the AFTER tree: the internode GPU cases of tests/gpu/test_multirank.py (every node layout
# and both killed-peer cases, ~125 s), then the 2x4 bf16-wire phase table (JAXEP_PHASE_TIMES=1,
# ~30 s each) of the BEFORE tree (/tmp/jaxep_before, unpacked by gpu_ab.sh) and of this tree, each
# built by gpu_ab.sh. The tables print last (rank 0's steps); the logs stay under $OUT/phase_*.
set -uo pipefail
OUT=${OUT:-/tmp/jaxep_ab}
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multirank.py \
  -k "x4 or x2 or x1 or x8 or killed" 2>&1 | tail -15
for d in /tmp/jaxep_before "$PWD"; do
  t=$(basename "$d")
  (cd "$d" && PYTHONPATH="$d" JAXEP_PHASE_TIMES=1 timeout 120 python3 tools/bench_multirank.py \
     --nproc 8 --experts 64 --iters 5 --ranks_per_node 4 --no-plot --outdir "$OUT/phase_$t" \
     -- --combine_wire_dtype=payload > "$OUT/phase_$t.txt" 2>&1; echo "phase $t rc=$?")
done
for d in /tmp/jaxep_before "$PWD"; do
  t=$(basename "$d")
  echo "== phase table, $t"
  grep -hE "^\[rank 0\] (phase times|  [a-z_]+/)" "$OUT"/phase_"$t"/bench_n*.log | sed 's/^\[rank 0\] //'
done

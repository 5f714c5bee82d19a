#!/usr/bin/env bash
# One device call for the multi-rank path: build, multi-rank GPU tier (N = 2, 4, 8 + killed peer),
# the EP=1 GPU tier, and (STAGE=bench) the 8-rank benchmark. Logs in $OUT; short table at the end.
set -uo pipefail
OUT=${OUT:-/tmp/jaxep_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PIP_BREAK_SYSTEM_PACKAGES=1
S="$OUT/summary.txt"; : > "$S"
say() { echo "$1" | tee -a "$S"; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader >> "$S" 2>&1
python3 -m pip uninstall -y jaxep > /dev/null 2>&1
JAXEP_CUDA=13 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; say "build rc=$? ($(( $(date +%s)-t0 ))s)"
python3 -c "import jaxep._ffi as f; print(f.is_available(), f.unavailable_reason(), f.build_info())" 2>&1 | tee -a "$S"
run() {  # name timeout cmd...
  local name=$1 to=$2; shift 2; local t=$(date +%s)
  timeout "$to" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  say "$name rc=$rc ($(( $(date +%s)-t ))s): $(grep -cE 'RESULT [0-9]+ \S+ ok' "$OUT/$name.log") ok, $(grep -cE 'RESULT [0-9]+ \S+ FAIL' "$OUT/$name.log") FAIL"
  grep -E '(RESULT [0-9]+ \S+ FAIL|KILLED|SUMMARY)' "$OUT/$name.log" | head -12 | tee -a "$S"
  grep -E 'Error|error|Segmentation|Traceback' "$OUT/$name.log" | grep -vE "RESULT|GRPC|WatchTasks|UNAVAILABLE|KILLED|ERROR jaxep" | head -6 | tee -a "$S"
  return $rc
}
W=tests/gpu/multirank_worker.py
FAILED=0
for N in ${NS:-2 4 8}; do
  run "mr_n$N" 150 python3 -m jaxep.launch --nproc $N --share-gpu --timeout 140 $W --case all --timeout_s 20 || { FAILED=1; break; }
done
if [ "${KILLED:-1}" = 1 ]; then
  run killed 120 python3 -m jaxep.launch --nproc 4 --share-gpu --timeout 100 $W --case killed --timeout_s 5
  grep -E "ERROR jaxep" "$OUT/killed.log" | head -2 | tee -a "$S"
fi
if [ "${EP1:-1}" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_ep1.py tests/gpu/test_backends_bitwise.py > "$OUT/ep1.log" 2>&1
  say "ep1 tier rc=$? : $(tail -1 "$OUT/ep1.log")"
fi
if [ "${BENCH:-0}" = 1 ] && [ $FAILED = 0 ]; then
  timeout 400 python3 tools/bench_multirank.py --nproc 8 --timeout 190 --outdir "$OUT" \
    --experts ${EXPERTS:-64,256} --iters ${ITERS:-10} --summary_json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  say "bench 8x rc=$?"; grep -A4 -E "^ +N +E +rc" "$OUT/bench.log" | tee -a "$S"
  grep -E "Error|error" "$OUT/bench.log" | grep -vE "GRPC|WatchTasks|UNAVAILABLE" | head -5 | tee -a "$S"
fi
say "total $(( $(date +%s)-t0 ))s"

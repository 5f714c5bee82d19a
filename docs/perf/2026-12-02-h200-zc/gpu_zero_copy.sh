#!/usr/bin/env bash
# Kept as the record of docs/performance.md §3's call 1, run from the tree of commit 4c4ba90 (it
# applies wip/zero-copy-combine.patch, which is in main since 11bcfcc/b0ee7b5 and gone from wip/).
# One device call (session 3, call 1): re-verify main's multi-rank tier after the 7849b56
# refactor, run docs/zero_copy.md's probe, and if every rank passes it apply
# wip/zero-copy-combine.patch, rebuild, run the whole multi-rank tier with it (incl. its zero-copy
# cases) and the same-run A/B bench (8 ranks, E=64, with and without --zero_copy).
#   OUT=/dir bash wip/gpu_zero_copy.sh
set -uo pipefail
T0=$(date +%s); TOTAL=${TOTAL:-575}
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PIP_BREAK_SYSTEM_PACKAGES=1
OUT=${OUT:?}; mkdir -p "$OUT/a" "$OUT/b"
OUT="$OUT/a" STEPS="build mr probe" BUDGET=${BUDGET_A:-300} bash tools/gpu_next.sh > /dev/null 2>&1
mkdir -p /tmp/a && tar xzf "$OUT/a/logs.tar.gz" -C /tmp/a
P=/tmp/a/logs/probe.log
okn=$(grep -cE "RESULT B1 rank=[0-9]+ ok" "$P" 2>/dev/null); okn=${okn:-0}
S="$OUT/b/summary.txt"; : > "$S"
echo "probe: $okn of 8 ranks ok" | tee -a "$S"
grep -E "RESULT B1 .*(SKIP|FAIL)" "$P" | head -5 | tee -a "$S"
left() { echo $(( TOTAL - ($(date +%s) - T0) - 10 )); }
run() {  # name cap cmd...
  local n=$1 cap=$2; shift 2; local l; l=$(left); local to=$(( cap < l ? cap : l ))
  if [ "$to" -lt 30 ]; then echo "$n skipped (time)" | tee -a "$S"; return 99; fi
  local t=$(date +%s); timeout -k 10 "$to" "$@" > "$OUT/b/$n.log" 2>&1; local rc=$?
  echo "$n rc=$rc $(( $(date +%s) - t ))s: $(tail -1 "$OUT/b/$n.log" | cut -c1-150)" | tee -a "$S"; return $rc
}
if [ "$okn" = 8 ] || [ "${FORCE_ZC:-0}" = 1 ]; then
  git apply wip/zero-copy-combine.patch && echo "patch applied" | tee -a "$S"
  run build 200 python3 -m pip install --no-build-isolation --no-deps -e .
  run mrzc 260 python3 -m pytest -v -rs -p no:cacheprovider tests/gpu/test_multirank.py
  grep -E "(PASSED|FAILED|SKIPPED|ERROR) +\[" "$OUT/b/mrzc.log" | cut -c1-140 | tee -a "$S"
  grep -hE "jaxep zero-copy: (on|off)" "$OUT/b/mrzc.log" | sort | uniq -c | head -4 | tee -a "$S"
  mkdir -p /tmp/bb
  run bench_zc 100 python3 tools/bench_multirank.py --nproc 8 --experts 64 --iters 10 --timeout 90 \
    --outdir /tmp/bb --summary_json /tmp/bb/zc.rows.json --zero_copy
  run bench_base 100 python3 tools/bench_multirank.py --nproc 8 --experts 64 --iters 10 --timeout 90 \
    --outdir /tmp/bb --summary_json /tmp/bb/base.rows.json
  grep -hE "jaxep zero-copy: (on|off)" /tmp/bb/*.log 2>/dev/null | sort | uniq -c | head -3 | tee -a "$S"
  python3 - <<'PY' 2>&1 | tee -a "$S"
import glob, json, sys
sys.path.insert(0, "tools"); import bench_multirank as b
rows = []
for p in ("/tmp/bb/zc.rows.json", "/tmp/bb/base.rows.json"):
    try: rows += json.load(open(p))
    except Exception as e: print("no rows", p, e)
print(b.table(rows) if rows else "no bench rows")
PY
  tar czf "$OUT/b/bench.tar.gz" -C /tmp bb 2>/dev/null
fi
echo "=== main (a) ==="; cat "$OUT/a/summary.txt"; echo "=== zero-copy (b) ==="; cat "$S"
echo "total $(( $(date +%s) - T0 ))s"

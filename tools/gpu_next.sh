#!/usr/bin/env bash
# One bounded device call that runs every GPU check and the benchmarks (runs 4-6 of
# docs/performance.md used it). From the repository root on the GPU machine:
#   OUT=/some/dir [STEPS="build mr bench8_64 ..."] BUDGET=560 bash tools/gpu_next.sh
# Steps in order, each bounded so the whole call ends within BUDGET seconds (480 by default; a step
# that no longer fits is reported as "skipped (time)"); STEPS= runs only the named ones:
#   build      JAXEP_CUDA=<nvcc's major> pip install --no-build-isolation --no-deps -e .
#              (extension with NVSHMEM, which that CUDA major then requires), ~20 s
#   mr         pytest tests/gpu/test_multirank.py: N = 2/4/8 bitwise, alternative kernels, killed
#              peer, the internode layouts (gputier runs it again: leave one of the two out)
#   mrn        only the internode cases of test_multirank.py (node override layouts, killed peer)
#   ll         only the low-latency cases of test_multirank.py (4, 8 ranks; 2 x 4; the CUDA-graph
#              replay on 4 and 8 ranks and the peer killed during a replay), ~250 s
#   benchll1 benchll1f ... benchll128 benchll128f   jaxep-bench --mode=low_latency, 8 ranks, E=256,
#              T = 1/8/32/128, bf16 / FP8 dispatch (...f), ~10 s each
#   benchll1g4 benchll128g4   the same as 2 emulated nodes x 4 (T = 1, 128)
#   phasell128 phase8_64 phase8_64g4 phase8_64f   the phase table (JAXEP_PHASE_TIMES=1, ffi/phase_times.h) of
#              benchll128 (XLA command buffers off, so the low-latency handlers are timed),
#              bench8_64 and bench8_64g4w (bf16 wire): where each op's time goes, 1x8 beside 2x4
#   bench8_64g4, bench8_64g4w, bench16seed   internode benches (2 x 4 f32 / bf16 wire; seed 2 x 8)
#   bench16seedf   bench16seed with dispatch's rows on the fp8 wire
#   bench8_64g4wa  2 x 4 bf16 wire with the thread-per-unit combine pull (combine_kernel="thread")
#   fp8quant   tools/time_fp8_quantize.py: the fp8 wire's quantize pass against a copy, ~20 s
#   fp8, bench8_64f, bench8_64g4wf   the fp8 dispatch wire: its GPU cases; bench8_64 and
#              bench8_64g4w with --dispatch_wire_dtype=float8_e4m3fn
# On a machine with at least N GPUs the N ranks of a step run one per GPU (the GPU tier's launches
# and tools/bench_multirank.py choose it; the bench table's kernels column says "gpu/rank"), else
# all N on one GPU under MPS (one H200: ~16 SMs each at N = 8).
#   bench8_64  jaxep-bench, 8 ranks on the GPU under MPS (~16 SMs each), CUDA, E=64, through
#              tools/bench_multirank.py (correctness vs the host oracle, table, JSON, PNG), ~40 s
#   bench8_64a the same with the alternative kernels (Config dispatch_kernel="row",
#              combine_kernel="thread"): same-run A/B, ~40 s
#   bench8_64s the same with zero-copy off (--staged: Config zero_copy=False): same-run A/B, ~40 s
#   nn         pytest tests/gpu/test_nn_multirank.py: the jaxep.nn layer on 2 and 4 ranks vs the
#              dense host reference, and examples/moe_flax.py --compare_backends (EP 1), ~125 s
#   gputier    pytest of tests/gpu (multi-rank driver, EP=1 tier, bitwise, bench on 2 ranks), ~170 s
#   ep1        pytest of tests/gpu without test_multirank.py (EP=1 tier, bitwise, bench on 2 ranks)
#   bench4_64, bench8_256, bench4_64a, bench4_64s   more bench setups, ~35 s each
#   ep1small   jaxep-bench at EP=1 and the example's tiny sizes (cuda vs reference), ~10 s
#   example    examples/moe_flax.py --compare_backends --dtype bfloat16 --steps 60, ~40 s
# All steps do not fit in one call: pick with STEPS (runs 5's list: "build mr bench8_64 bench8_64a
# bench4_64 bench8_256 bench4_64a ep1small example", 372 s).
# Output in $OUT: summary.txt (the table, printed last) and logs.tar.gz (every log, JSON, PNG).
# CPU dry run of this script's flow (no GPU: the GPU tests skip, the bench runs on the reference):
#   BUILD=0 JAX_PLATFORMS=cpu BENCH_EXTRA="--backend reference --no-share-gpu --tokens 16 --hidden 32
#   --topk 2" OUT=/tmp/dry bash tools/gpu_next.sh
set -uo pipefail
OUT=${OUT:-/tmp/jaxep_out}; mkdir -p "$OUT"
LOGS="$OUT/logs"; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PIP_BREAK_SYSTEM_PACKAGES=1
export JAXEP_LOG_LEVEL=${JAXEP_LOG_LEVEL:-INFO}
BUDGET=${BUDGET:-480}
T0=$(date +%s)
S="$OUT/summary.txt"; : > "$S"
ROWS="$LOGS/rows.txt"; : > "$ROWS"
left() { echo $(( BUDGET - ($(date +%s) - T0) - 15 )); }   # 15 s kept for the table and the tar
row() { printf '%-11s %-16s %5ss  %s\n' "$1" "$2" "$3" "$4" >> "$ROWS"; }

# STEPS="build mr bench8_64 ..." runs only the named steps (default: every step).
wanted() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }

# step NAME CAP MIN LOG CMD...: runs CMD with timeout min(CAP, time left); skipped when < MIN left.
step() {
  local name=$1 cap=$2 min=$3 log=$4; shift 4
  wanted "$name" || return 0
  local l; l=$(left)
  if [ "$l" -lt "$min" ]; then row "$name" "skipped (time)" 0 "needs ${min}s, ${l}s left"; return 99; fi
  local to=$(( cap < l ? cap : l )) t=$(date +%s)
  echo "=== $name (timeout ${to}s): $*" | tee -a "$LOGS/commands.txt"
  timeout -k 15 "$to" "$@" > "$log" 2>&1; local rc=$?
  local st=ok; [ $rc = 124 ] && st="TIMEOUT" || { [ $rc != 0 ] && st="FAIL rc=$rc"; }
  LAST_SECS=$(( $(date +%s) - t ))
  row "$name" "$st" "$LAST_SECS" "$(grep -vE '^(pcopy|$)' "$log" | tail -1 | cut -c1-110)"
  return $rc
}

{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  python3 -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} > "$LOGS/machine.txt" 2>&1
head -3 "$LOGS/machine.txt" | tee -a "$S"

if [ "${BUILD:-1}" = 1 ]; then   # BUILD=0: use the extension already built (CPU dry runs of this script)
  python3 -m pip uninstall -y jaxep > /dev/null 2>&1   # a stale editable install would shadow ./jaxep
  # JAXEP_CUDA: pip runs CMake only when asked (docs/build.md); the major of the nvcc found, so a
  # missing or other-major NVSHMEM wheel fails the build instead of a silent single-rank one.
  CUDA_MAJOR=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  # Needs 45 s left (a build takes ~20 s). A build that was skipped or failed is said first in
  # the summary: the steps then run whatever module ./jaxep already holds (session 10's call 6
  # ran an earlier call's module that way, its build skipped for time).
  if wanted build && ! step build 240 45 "$LOGS/build.log" env JAXEP_CUDA="${CUDA_MAJOR:-ON}" \
      python3 -m pip install --no-build-isolation --no-deps -e .; then
    echo "WARNING: the build step was skipped or failed; the steps below use the module already in ./jaxep, if any" | tee -a "$S"
  fi
fi
python3 -c "import jaxep._ffi as f; print('extension', f.is_available(), f.unavailable_reason(), f.build_info())" \
  2>&1 | tail -1 | tee -a "$S" "$LOGS/build_info.txt"

bench() {  # name nproc experts cap [dispatch kernel] [combine kernel] [more flags]
  local l; l=$(left); local to=$(( $4 < l ? $4 : l ))
  step "$1" "$4" 60 "$LOGS/$1.log" python3 tools/bench_multirank.py --nproc "$2" --experts "$3" \
    --iters 10 --timeout $(( to - 20 )) --outdir "$LOGS" --summary_json "$LOGS/$1.rows.json" \
    --dispatch_kernel "${5:-token}" --combine_kernel "${6:-warp}" ${BENCH_EXTRA:-} ${7:-}
  # (BENCH_EXTRA before the step's flags: those may end in "-- <jaxep-bench flags>")
}
# The multi-rank driver alone (STEPS=mr; gputier below runs it too); mrn: its internode cases only
# (2 x 4, 4 x 2, 8 x 1, 2 x 8 layouts, the killed peer on the other node).
step mr 420 120 "$LOGS/mr.log" python3 -m pytest -v -rs -p no:cacheprovider tests/gpu/test_multirank.py
step mrn 300 120 "$LOGS/mrn.log" python3 -m pytest -v -rsP -p no:cacheprovider \
  tests/gpu/test_multirank.py -k "x4 or x2 or x1 or x8 or killed"
# fp8: the fp8 dispatch wire (Config.dispatch_wire_dtype) bitwise on the kernels: 4 ranks, 2 x 4,
# the row pull, 4 x 2 staged, a peer killed before dispatch (mr runs them too), EP size 1 and the
# one-pass quantize, the quantize on tests/fp8_hard_inputs.py's values, ~150 s.
step fp8 300 90 "$LOGS/fp8.log" python3 -m pytest -v -rs -p no:cacheprovider \
  tests/gpu/test_multirank.py tests/gpu/test_cuda_ep1.py -k "fp8wire or fp8_wire or quantize_rows or quantize_hard"
# mode="low_latency" on the CUDA backend (4 and 8 ranks, one node and 2 x 4; mr runs it too).
step ll 400 90 "$LOGS/ll.log" python3 -m pytest -v -rsP -p no:cacheprovider \
  tests/gpu/test_multirank.py -k low_latency
bench bench8_64 8 64 150
# Internode under the node override (8 ranks as 2 emulated nodes x 4; same inputs as bench8_64):
# f32 wire, then the payload (bf16) wire. bench16seed: the seed's 2 x 8 shape (--preset=seed_2x8).
bench bench8_64g4 8 64 150 token warp "--ranks_per_node 4"
bench bench8_64g4w 8 64 150 token warp "--ranks_per_node 4 -- --combine_wire_dtype=payload"
# bench8_64g4wa: the same with the thread-per-unit combine pull (Config combine_kernel="thread").
bench bench8_64g4wa 8 64 150 token thread "--ranks_per_node 4 -- --combine_wire_dtype=payload"
# bench8_64f, bench8_64g4wf: bench8_64 and bench8_64g4w with dispatch's rows on the fp8 wire.
bench bench8_64f 8 64 150 token warp "-- --dispatch_wire_dtype=float8_e4m3fn"
bench bench8_64g4wf 8 64 150 token warp \
  "--ranks_per_node 4 -- --combine_wire_dtype=payload --dispatch_wire_dtype=float8_e4m3fn"
step bench16seed 240 120 "$LOGS/bench16seed.log" \
  python3 tools/bench_multirank.py --nproc 16 --experts 128 --ranks_per_node 8 --iters 10 \
  --timeout 220 --outdir "$LOGS" --summary_json "$LOGS/bench16seed.rows.json" -- \
  --preset=seed_2x8 --combine_wire_dtype=payload
# bench16seedf: the same with dispatch's rows on the fp8 wire (the preset's "bf16 and fp8").
step bench16seedf 240 120 "$LOGS/bench16seedf.log" \
  python3 tools/bench_multirank.py --nproc 16 --experts 128 --ranks_per_node 8 --iters 10 \
  --timeout 220 --outdir "$LOGS" --summary_json "$LOGS/bench16seedf.rows.json" -- \
  --preset=seed_2x8 --combine_wire_dtype=payload --dispatch_wire_dtype=float8_e4m3fn
# mode="low_latency" (jaxep-bench --mode=low_latency): 8 ranks, E=256, H=7168, K=8, bf16 and
# FP8 dispatch, at T = 1, 8, 32, 128 per rank (one launch each; ops vs the same-run sync floor and
# payload copy).
# The low-latency area (2 x L x R x min(M, T*K) rows: ~0.94 GB at T=128) needs more than NVSHMEM's
# 1 GiB default heap (jaxep.initialize says so and prints the value).
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-2147483648}
for t in 1 8 32 128; do
  bench "benchll$t" 8 256 90 token warp "--tokens $t -- --mode=low_latency"
  bench "benchll${t}f" 8 256 90 token warp "--tokens $t -- --mode=low_latency --fp8_dispatch"
done
# The same at T = 1 and 128 as 2 emulated nodes x 4 (the low-latency kernels' puts to the other
# node: NVSHMEM over P2P on one GPU).
bench benchll1g4 8 256 90 token warp "--ranks_per_node 4 --tokens 1 -- --mode=low_latency"
bench benchll128g4 8 256 90 token warp "--ranks_per_node 4 --tokens 128 -- --mode=low_latency"
# The phase tables: the GPU time of each step of each call on process 0 (the events cost ~15-25 %
# of the op, so read the steps' shares, not the totals). The low-latency one runs without XLA's
# command buffers: a captured call records nothing (phase_times.h).
JAXEP_PHASE_TIMES=1 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
  bench phasell128 8 256 90 token warp \
  "--tokens 128 --iters 5 --no-plot --outdir $LOGS/phasell128 -- --mode=low_latency"
unset NVSHMEM_SYMMETRIC_SIZE
JAXEP_PHASE_TIMES=1 bench phase8_64 8 64 120 token warp "--iters 5 --no-plot --outdir $LOGS/phase8_64"
JAXEP_PHASE_TIMES=1 bench phase8_64g4 8 64 120 token warp \
  "--iters 5 --no-plot --outdir $LOGS/phase8_64g4 --ranks_per_node 4 -- --combine_wire_dtype=payload"
# fp8quant: the fp8 wire's source pass alone (jaxep_fp8_quantize_rows, whole GPU, one process)
# against a same-run copy of its bytes, ~20 s.
step fp8quant 90 30 "$LOGS/fp8quant.log" python3 tools/time_fp8_quantize.py
# phase8_64f: phase8_64 on the fp8 dispatch wire (its pull beside the payload wire's).
JAXEP_PHASE_TIMES=1 bench phase8_64f 8 64 120 token warp \
  "--iters 5 --no-plot --outdir $LOGS/phase8_64f -- --dispatch_wire_dtype=float8_e4m3fn"
bench bench8_64a 8 64 120 row thread   # the alternative pull kernels: same inputs, same call
bench bench8_64s 8 64 120 token warp --staged   # zero-copy off (Config zero_copy=False): same-run A/B
step nn 200 90 "$LOGS/nn.log" python3 -m pytest -v -rsP -p no:cacheprovider tests/gpu/test_nn_multirank.py
# The rest of tests/gpu, the multi-rank driver first (never run under pytest on a GPU before);
# -v: a step cut by its timeout still shows which tests finished.
step gputier 300 120 "$LOGS/gputier.log" python3 -m pytest -v -rs -p no:cacheprovider \
  tests/gpu/test_multirank.py tests/gpu/test_cuda_ep1.py tests/gpu/test_backends_bitwise.py \
  tests/gpu/test_bench_multirank.py
# The EP=1 tier, the backends' bitwise comparison and the bench's own test (gputier without the
# multi-rank driver: STEPS="mr ep1" covers gputier in ~60 s less).
step ep1 200 60 "$LOGS/ep1.log" python3 -m pytest -v -rs -p no:cacheprovider \
  tests/gpu/test_cuda_ep1.py tests/gpu/test_backends_bitwise.py tests/gpu/test_bench_multirank.py
bench bench4_64 4 64 120
bench bench8_256 8 256 120
bench bench4_64a 4 64 120 row thread
bench bench4_64s 4 64 120 token warp --staged
# EP=1 at the example's tiny sizes (cuda vs the reference in one run: per-call overheads) and the
# example's own comparison at its default sizes.
step ep1small 90 40 "$LOGS/ep1small.log" python3 -m jaxep.bench --backend cuda --tokens 2048 \
  --hidden 128 --topk 2 --experts 8 --dtype bfloat16 --iters 20 --json "$LOGS/ep1small.json"
step example 180 60 "$LOGS/example.log" python3 examples/moe_flax.py --compare_backends \
  --dtype bfloat16 --steps 60

timeout 30 python3 -m jaxep.doctor > "$LOGS/doctor.log" 2>&1 || true

# ---------------------------------------------------------------- the table (printed last)
{
  echo "--- layer test and example (from nn.log) ---"
  grep -hE "^rank [0-9]+ (hlo|step[0-9]) (ok|FAIL)|cuda [0-9]+ tokens/s, reference" "$LOGS/nn.log" 2>/dev/null | cut -c1-200 | head -16
  grep -hE "^(FAILED|ERROR) |(PASSED|FAILED|SKIPPED|ERROR) +\[" "$LOGS/nn.log" "$LOGS/mr.log" "$LOGS/mrn.log" "$LOGS/ll.log" "$LOGS/gputier.log" "$LOGS/ep1.log" 2>/dev/null \
    | grep -vE "test_cuda_ep1.py.*PASSED|test_backends_bitwise.py.*PASSED" | cut -c1-160 | head -14
  cat "$LOGS/gputier.log" "$LOGS/ep1.log" 2>/dev/null | grep -cE "test_cuda_ep1.py.*PASSED|test_backends_bitwise.py.*PASSED" \
    | sed 's/^/EP=1 tier tests passed: /'

  grep -hE "cuda [0-9]+ tokens/s, reference|^throughput|dense check" "$LOGS/example.log" 2>/dev/null | cut -c1-200
  grep -hiE "^ *(dispatch|combine|both) .*(ms|x)" "$LOGS/ep1small.log" 2>/dev/null | head -8 | cut -c1-200
  echo "--- bench (tools/bench_multirank.py table over every run) ---"
  python3 - "$LOGS" <<'EOF' 2>&1
import glob, json, os, sys
sys.path.insert(0, "tools")
import bench_multirank as b
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.rows.json")), key=os.path.getmtime):
    rows += json.load(open(path))
print(b.table(rows) if rows else "no bench rows")
for r in rows:
    if r.get("ok") is None:
        print(f"N={r['N']} E={r['E']}: no JSON (rc={r['rc']}); see logs/bench_n{r['N']}_e{r['E']}.log")
EOF
  grep -hE "BenchCorrectnessError|TimeoutError|Traceback|failed:|error:" "$LOGS"/bench_n*_e*.log 2>/dev/null | cut -c1-200 | head -6
  grep -h "^fp8 quantize rows" "$LOGS/fp8quant.log" 2>/dev/null
  for d in phasell128 phase8_64 phase8_64g4 phase8_64f; do   # the phase tables (rank 0's)
    for f in "$LOGS/$d"/bench_n*.log; do
      [ -f "$f" ] && { echo "$d:"; grep -hE "^\[rank 0\] (phase times|  [a-z_]+/)" "$f" | sed 's/^\[rank 0\] //'; }
    done
  done
  for f in "$LOGS"/bench_n*_mode-low-latency*.log; do   # the low-latency tables (rank 0's)
    [ -f "$f" ] && grep -hE -A6 "jaxep-bench low_latency:" "$f" | sed 's/^\[rank 0\] //' | head -7
  done
  echo "--- steps ---"
  cat "$ROWS"
  echo "total $(( $(date +%s) - T0 ))s of ${BUDGET}s"
} >> "$S"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
cat "$S"

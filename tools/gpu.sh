#!/usr/bin/env bash
# tools/gpu.sh: the GPU machine's one entry point (docs/gpu.md). From the repository root:
#
#   tools/gpu.sh STEP [STEP...]          e.g.  tools/gpu.sh build tier
#                                              tools/gpu.sh build reliability sanitize
#                                              tools/gpu.sh build ab 205b90b
#   tools/gpu.sh ab-archive BASE         here, before the call: `git archive` of BASE into .gpu/
#   tools/gpu.sh help
#
# Steps (expected time on the one-H200 machine; each runs under its own time box, CAP seconds,
# shortened to what is left of GPU_TIME_LIMIT, 580 s by default, counted from the script's start;
# a step that no longer fits is reported "skipped (time)"):
#   build        the CUDA extension of this tree: CMake + Ninja, all cores, CUDA major of nvcc
#                (NVSHMEM required), JAXEP_CUDA_ARCHITECTURES (default 90: the H200 only), the module
#                copied into jaxep/; no pip install (an editable install would shadow the `ab`
#                step's other tree). ~40 s, cap 240
#   tier         the GPU tier, every case (EP 1, 2/4/8 ranks, internode layouts, low latency and
#                its graph replays, killed peers, the layer, the bench), as its parts, each its own
#                pytest process: tier-ep1 (EP 1, bitwise, bench; 68 s), tier-mr1 and tier-mr2
#                (test_multirank.py: the normal-mode bitwise cases, then the low-latency and
#                killed-peer cases; 364 s for both on the H200, the last run with per-case times
#                in each part's pytest.log, --durations=0), tier-nn (the layer; 126 s). `tier-mr`
#                = tier-mr1 tier-mr2. ~560 s in all, more than one call: run `build tier-mr`,
#                then `build tier-ep1 tier-nn`. (All of tests/gpu in one process failed a 4-rank
#                case there that passes in tier-mr, probably the EP-1 tests' JAX holding the
#                memory the ranks need.)
#   bench        the benchmark cases (CASES, default all): n8 = 8 ranks x ~16 SMs, n4 = 4 ranks x
#                ~33 SMs (E=64, T=4096, H=7168, K=8, bf16), ll1 / ll128 = low latency T=1 / 128
#                (8 ranks, E=256), seed = --preset=seed_2x8 (16 ranks as 2x8). Each through
#                jaxep-bench, which checks its outputs against the host oracle before timing.
#                ~40 + 30 + 25 + 30 + 120 s, cap 540
#   ab BASE      BASE's tree (from .gpu/ab-BASE.tar, made by `ab-archive`; else `git archive` if
#                .git is here) and this one, built side by side, then the bench cases run on both,
#                interleaved BASE, this, BASE, this (two rounds: the noise of one tree is the spread
#                of its two rounds), then the outputs' sha256 of both trees at the n8 and ll128
#                shapes (tests/gpu/reliability_worker.py --digest). The whole list does not fit one
#                call: CASES="n8 n4" (~330 s), CASES="ll1 ll128" (~280 s), CASES="seed" (~540 s)
#                with DIGEST=0. cap 560
#   reliability  10,000 dispatch + combine calls on each of 8 ranks (one GPU, MPS), random 0-4 ms
#                host delays, every call's checksum against the oracle, sampled calls bitwise
#                (tests/gpu/reliability_worker.py; CALLS=N). ~60-120 s, cap 300
#   sanitize     compute-sanitizer memcheck, racecheck, synccheck on EP 1 and on 2 ranks (under MPS;
#                without it when the sanitizer refuses MPS), normal and low-latency modes, small
#                shapes; error counts. TOOLS="memcheck racecheck synccheck", SETUPS="ep1 r2",
#                MODES="normal low_latency" pick. ~300-500 s (not yet measured), cap 560
#   ranks        32 and 48 ranks on the one GPU under MPS (4x8, 1x32, 6x8), bitwise against the
#                oracle every call; says REFUSED where jaxep.initialize refuses the rank count.
#                ~150-300 s, cap 540
#   cmdbuf       8 scanned MoE layers, forward + backward, XLA command buffers off and on (each of
#                the worker's candidate flag sets, CMDBUF_CANDIDATES=a,b to pick) in one process
#                (tests/gpu/cmdbuf_worker.py: counts each executable's command buffers, fails when
#                no "on" holds one), 8 ranks then EP 1; step time ratios. Not yet timed with the
#                candidates (5 compiles a variant), cap 480
#   hosts        two "hosts" on the one GPU (jaxep.launch --nnodes 2, node 1 under another kernel
#                boot id; needs root and unshare): 2 x 2 ranks of tests/gpu/multirank_worker.py,
#                every case bitwise; then a bootstrap interface that does not exist must fail fast,
#                named. ~150 s, cap 330
#
# Output under $OUT (default /tmp/jaxep_gpu): summary.txt (one line a step and the table, printed
# last) and <step>.tgz (that step's logs, JSON, PNG: `tar xzf`); the device tool brings back at
# most 8 files, so each step's folder $OUT/<step>/ is packed as soon as it ends.
# Environment: GPU_TIME_LIMIT (s, 580), CASES, CALLS, ROUNDS (ab, 2), DIGEST (ab, 1), TOOLS,
# SETUPS, MODES, JOBS (build, all cores), JAXEP_CUDA_ARCHITECTURES (90).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# What BASE's tarball holds: what builds and runs the extension, the bench and the tests.
AB_PATHS="CMakeLists.txt pyproject.toml ffi jaxep tests examples"

# ------------------------------------------------------------------------------ here: ab-archive
if [ "${1:-}" = "ab-archive" ]; then
  base=${2:?usage: tools/gpu.sh ab-archive BASE}
  mkdir -p .gpu
  git archive -o ".gpu/ab-$base.tar" "$base" -- $AB_PATHS || exit 1
  echo "wrote .gpu/ab-$base.tar ($(du -h ".gpu/ab-$base.tar" | cut -f1)); .gpu/ is ignored by git:"
  echo "name it in the device call's carry: carry=[\".gpu\"], command tools/gpu.sh build ab $base"
  exit 0
fi
case "${1:-help}" in help|-h|--help) usage; exit 0;; esac

OUT=${OUT:-/tmp/jaxep_gpu}; mkdir -p "$OUT"
S="$OUT/summary.txt"; : > "$S"
ROWS="$OUT/.rows"; : > "$ROWS"
T0=$(date +%s)
TIME_LIMIT=${GPU_TIME_LIMIT:-580}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 8)}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_BREAK_SYSTEM_PACKAGES=1 JAXEP_LOG_LEVEL=${JAXEP_LOG_LEVEL:-INFO}
# No NVLink multicast, ever (docs/gpu.md).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

say() { echo "$*" | tee -a "$S"; }
now() { date +%s; }
left() { echo $(( TIME_LIMIT - ($(now) - T0) - 10 )); }   # 10 s kept for packing and the table
# cap N: N seconds, or what is left of the step's time box if less (at least 1)
cap() { local l=$(( STEP_END - $(now) )); [ "$l" -lt "$1" ] && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
# box N LOG CMD...: CMD under `timeout` (cap N), output to LOG; returns CMD's code (124: timed out)
box() {
  local n; n=$(cap "$1"); local log=$2; shift 2
  echo "+ (timeout ${n}s) $*" >> "$D/commands.txt"
  timeout -k 10 "$n" "$@" > "$log" 2>&1
}
# LAUNCH NPROC TIMEOUT ARGS...: (inside `box`) the ranks on the one GPU under MPS
SHARE=--share-gpu; WB=(); BENCH_BACKEND=cuda
if [ "${GPU_DRY_RUN:-0}" = 1 ]; then
  # CPU dry run of this script's flow: no build, ranks as CPU processes, the reference backend,
  # tiny shapes (docs/gpu.md). Nothing it prints is a GPU result.
  export JAX_PLATFORMS=cpu
  SHARE=""; WB=(--backend reference); BENCH_BACKEND=reference
fi
LAUNCH=(python3 -m jaxep.launch $SHARE --nproc)
[ "${GPU_DRY_RUN:-0}" = 1 ] && DRY_SHAPE="--tokens 16 --hidden 64" \
  DRY_SHAPE_CMDBUF="--layers 2 --tokens 32 --hidden 64 --ffn 64 --iters 2 --rounds 2 --warmup 1"

ext_info() {  # the extension's state in one line (works before and after module moves)
  python3 - <<'PY' 2>&1 | tail -1
import importlib
m = None
for name in ("jaxep._extension", "jaxep._ffi"):
    try:
        m = importlib.import_module(name)
        break
    except ImportError:
        pass
if m is None:
    print("extension: no jaxep._extension / jaxep._ffi module")
elif not m.is_available():
    print("extension: NOT available:", m.unavailable_reason())
else:
    b = m.build_info()
    print("extension: available, multi_rank", b.get("multi_rank"), "archs", b.get("cuda_archs"),
          "nvshmem", b.get("nvshmem"), "at", getattr(m, "__file__", "?"))
PY
}

# build_tree DIR TAG LOG: CMake + Ninja into /tmp/jaxep-build/TAG, module copied into DIR's package
build_tree() {
  if [ "${GPU_DRY_RUN:-0}" = 1 ]; then echo "dry run: $1 not built" > "$3"; return 0; fi
  local dir=$1 tag=$2 log=$3 major py dest bdir=/tmp/jaxep-build/$2
  major=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  py=$(command -v python3)
  dest=$(sed -n 's/^install(TARGETS .* DESTINATION \([A-Za-z0-9_/]*\)).*/\1/p' "$dir/CMakeLists.txt" | head -1)
  {
    echo "tree $dir, nvcc CUDA ${major:-?}, archs ${JAXEP_CUDA_ARCHITECTURES:-90}, module to ${dest:-jaxep}/"
    cmake -S "$dir" -B "$bdir" -G Ninja -DPython_EXECUTABLE="$py" -DCMAKE_BUILD_TYPE=Release \
      -DJAXEP_CUDA="${major:-ON}" -DJAXEP_REQUIRE_NVSHMEM=ON \
      -DJAXEP_CUDA_ARCHITECTURES="${JAXEP_CUDA_ARCHITECTURES:-90}" \
    && cmake --build "$bdir" -j "$JOBS" \
    && rm -f "$dir/${dest:-jaxep}"/_jaxep_cuda*.so \
    && cp "$bdir"/_jaxep_cuda*.so "$dir/${dest:-jaxep}/"
  } > "$log" 2>&1
}

# ------------------------------------------------------------------------------ bench cases
# case_args CASE: "NPROC LAUNCH_TIMEOUT jaxep-bench flags..." of one named case
case_args() {
  local big="--tokens=4096 --hidden=7168 --topk=8 --dtype=bfloat16 --iters=10"
  if [ "${GPU_DRY_RUN:-0}" = 1 ]; then  # the same cases' rank counts, tiny shapes
    local tiny="--hidden=128 --topk=2 --iters=1 --warmup=1 --inner=1"
    case $1 in
      n8) echo "8 150 --experts=16 --tokens=16 $tiny";; n4) echo "4 150 --experts=16 --tokens=16 $tiny";;
      ll1|ll128) echo "4 150 --experts=16 --tokens=${1#ll} --mode=low_latency $tiny";;
      seed) echo "4 150 --experts=16 --tokens=16 --ranks_per_node=2 $tiny";; *) return 1;;
    esac
    return 0
  fi
  case $1 in
    n8) echo "8 150 --experts=64 $big";;
    n4) echo "4 120 --experts=64 $big";;
    ll1) echo "8 100 --experts=256 --tokens=1 --hidden=7168 --topk=8 --dtype=bfloat16 --iters=10 --mode=low_latency";;
    ll128) echo "8 100 --experts=256 --tokens=128 --hidden=7168 --topk=8 --dtype=bfloat16 --iters=10 --mode=low_latency";;
    seed) echo "16 260 --preset=seed_2x8 --combine_wire_dtype=payload --iters=10";;
    *) return 1;;
  esac
}
ALL_CASES="n8 n4 ll1 ll128 seed"
# bench_case TREE CASE TAG: one jaxep-bench launch in TREE; JSON/log/PNG named TAG in $D
bench_case() {
  local tree=$1 c=$2 tag=$3 spec n t flags rc
  spec=$(case_args "$c") || { echo "unknown case $c" >> "$D/$tag.log"; return 2; }
  read -r n t flags <<< "$spec"
  [ "$(cap $((t + 20)))" -lt 40 ] && { echo "$tag: skipped (time)"; return 99; }
  # The low-latency area needs more than NVSHMEM's 1 GiB default heap at E=256, T=128.
  # shellcheck disable=SC2086  # flags are words
  ( cd "$tree" && PYTHONPATH="$tree" NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-2147483648} \
      box $((t + 20)) "$D/$tag.log" python3 -m jaxep.launch --nproc "$n" $SHARE --timeout "$(cap "$t")" \
      -m jaxep.bench --backend=$BENCH_BACKEND $flags --json="$D/$tag.json" )
  rc=$?
  echo "$tag: rc=$rc $(grep -hoE 'correctness: [A-Z]+[^,;]*' "$D/$tag.log" | head -1)"
  return $rc
}
# bench_table DIR: one row per JSON in DIR (name, correctness, dispatch/combine/both medians)
bench_table() {
  python3 - "$1" <<'PY'
import glob, json, os, sys
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    name = os.path.basename(path)[:-5]
    try:
        doc = json.load(open(path))
        ops = doc["ops"]
        med = {op: ops[op]["time_s"]["median"] * 1e3 for op in ("dispatch", "combine", "both")}
        pc = {op: ops[op].get("payload", {}).get("copy_over_op") for op in ("dispatch", "combine")}
        ok = doc["correctness"]["passed"]
    except Exception as e:  # a run that died leaves no or a partial JSON
        print(f"{name:<22} unreadable JSON: {type(e).__name__}")
        continue
    f = lambda v: "-" if v is None else f"{v:.2f}"
    print(f"{name:<22} correct={'yes' if ok else 'NO'} dispatch {med['dispatch']:8.3f} ms  "
          f"combine {med['combine']:8.3f} ms  both {med['both']:8.3f} ms  "
          f"payload-copy/op d {f(pc['dispatch'])} c {f(pc['combine'])}")
if not rows and not glob.glob(os.path.join(sys.argv[1], "*.json")):
    print("no bench JSON")
PY
}

# ------------------------------------------------------------------------------ steps
# Each step_X writes into $D and sets LINE (its one-line summary); returns 0 when it passed.
step_build() {
  # An installed jaxep would shadow ./jaxep (not on a dry run: that machine's Python is shared).
  [ "${GPU_DRY_RUN:-0}" = 1 ] || python3 -m pip uninstall -y jaxep > "$D/pip_uninstall.log" 2>&1
  local n; n=$(cap 240)
  echo "+ build_tree $ROOT (timeout ${n}s)" >> "$D/commands.txt"
  timeout -k 10 "$n" bash -c "$(declare -f build_tree); JOBS=$JOBS build_tree '$ROOT' current '$D/build.log'"
  local rc=$?
  LINE="rc=$rc; $(ext_info | tee "$D/extension.txt")"
  [ $rc = 0 ] && grep -q "multi_rank True" "$D/extension.txt"
}

tier_run() {  # tier_run CAP PYTEST-ARGS...
  local c=$1; shift
  box "$c" "$D/pytest.log" python3 -m pytest -v -rs --durations=0 -p no:cacheprovider "$@"
  local rc=$?
  LINE="rc=$rc: $(grep -E '^=+ .*(passed|failed|error|skipped).* in ' "$D/pytest.log" | tail -1 | tr -d '=' | sed 's/^ *//')"
  grep -E "^(FAILED|ERROR) " "$D/pytest.log" | head -8 | sed 's/^/    /' >> "$D/failures.txt"
  [ -s "$D/failures.txt" ] && LINE="$LINE; $(head -3 "$D/failures.txt" | tr -s ' ' | cut -c1-120 | paste -sd';')"
  [ $rc = 0 ]
}
step_tier_ep1() { tier_run 200 tests/gpu/test_cuda_ep1.py tests/gpu/test_backends_bitwise.py tests/gpu/test_bench_multirank.py; }
# test_multirank.py's 32 cases took 362 s in one process (2026-12-05, H200), past the box left to
# them after a build; its two halves by kind, each its own process and box (~1.5x its share).
step_tier_mr1() { tier_run 300 tests/gpu/test_multirank.py -k multirank_bitwise; }
step_tier_mr2() { tier_run 300 tests/gpu/test_multirank.py -k "not multirank_bitwise"; }
step_tier_nn() { tier_run 240 tests/gpu/test_nn_multirank.py; }

step_bench() {
  local c fails=0
  for c in ${CASES:-$ALL_CASES}; do
    bench_case "$ROOT" "$c" "$c" >> "$D/runs.txt" || fails=$((fails + 1))
  done
  bench_table "$D" > "$D/table.txt"
  cat "$D/table.txt" >> "$S.tables"
  LINE="$(wc -l < "$D/table.txt") runs, $fails failed or skipped ($(paste -sd' ' "$D/runs.txt" | cut -c1-200))"
  [ $fails = 0 ]
}

step_ab() {
  local base=$AB_BASE tar=".gpu/ab-$AB_BASE.tar" btree=/tmp/jaxep-ab-base
  if [ ! -f "$tar" ]; then
    if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then
      mkdir -p .gpu && git -C "$ROOT" archive -o "$tar" "$base" -- $AB_PATHS 2> "$D/archive.log"
    fi
  fi
  if [ ! -f "$tar" ]; then
    LINE="no $tar and no git here: run 'tools/gpu.sh ab-archive $base' before the call and carry .gpu"
    return 1
  fi
  rm -rf "$btree" && mkdir -p "$btree" && tar xf "$tar" -C "$btree" || { LINE="cannot unpack $tar"; return 1; }
  # Both trees built at once, half the cores each.
  local n; n=$(cap 300)
  timeout -k 10 "$n" bash -c "$(declare -f build_tree); JOBS=$(( (JOBS + 1) / 2 )) build_tree '$btree' base '$D/build_base.log'" &
  local pid=$!
  timeout -k 10 "$n" bash -c "$(declare -f build_tree); JOBS=$(( (JOBS + 1) / 2 )) build_tree '$ROOT' current '$D/build_current.log'"
  local rc_cur=$? rc_base=0
  wait $pid || rc_base=$?
  { echo "base $base: rc=$rc_base $(cd "$btree" && PYTHONPATH=$btree ext_info)"
    echo "current: rc=$rc_cur $(ext_info)"; } | tee "$D/builds.txt" > /dev/null
  if [ $rc_base != 0 ] || [ $rc_cur != 0 ]; then LINE="build failed: $(paste -sd';' "$D/builds.txt")"; return 1; fi
  local r c fails=0
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for c in ${CASES:-$ALL_CASES}; do
      bench_case "$btree" "$c" "${c}_base_r$r" >> "$D/runs.txt" || fails=$((fails + 1))
      bench_case "$ROOT" "$c" "${c}_cur_r$r" >> "$D/runs.txt" || fails=$((fails + 1))
    done
  done
  local dig="" sh
  if [ "${DIGEST:-1}" = 1 ]; then
    for sh in n8 ll128; do
      local wflags="--calls 2 --delay_ms 0 --inputs 2 --check none --digest --topk 8 --hidden 7168"
      DIGEST_NPROC=8
      case $sh in
        n8) wflags="$wflags --tokens 4096 --experts 64";;
        ll128) wflags="$wflags --tokens 128 --experts 256 --mode low_latency --rows_per_expert bench";;
      esac
      [ "${GPU_DRY_RUN:-0}" = 1 ] && { DIGEST_NPROC=2; wflags="${wflags/--hidden 7168/--hidden 128} --tokens 8 --experts 16"; }
      for tree in "$btree" "$ROOT"; do
        local who=cur heap; [ "$tree" = "$btree" ] && who=base
        [ "$(cap 200)" -lt 60 ] && { echo "digest $sh $who: skipped (time)" >> "$D/runs.txt"; continue; }
        # The heap that tree's jaxep.initialize recommends for the digest's config (the worker's
        # --heap_for_ranks: Params.of, symmetric_bytes, recommended_env); the ll128 digest runs
        # at jaxep-bench's M (--rows_per_expert bench), the shapes the bench times.
        # shellcheck disable=SC2086
        heap=$(cd "$tree" && PYTHONPATH="$tree" timeout 120 python3 "$ROOT/tests/gpu/reliability_worker.py" \
                 $wflags --heap_for_ranks "$DIGEST_NPROC" 2>> "$D/digest_heap.log" | tee -a "$D/digest_heap.log" \
               | sed -n 's/^HEAP \([0-9]*\) .*/\1/p')
        echo "digest $sh $who: NVSHMEM_SYMMETRIC_SIZE=${heap:-${NVSHMEM_SYMMETRIC_SIZE:-2147483648} (no recommendation)}" >> "$D/runs.txt"
        # shellcheck disable=SC2086
        ( cd "$tree" && PYTHONPATH="$tree" NVSHMEM_SYMMETRIC_SIZE=${heap:-${NVSHMEM_SYMMETRIC_SIZE:-2147483648}} \
            box 200 "$D/digest_${sh}_$who.log" python3 -m jaxep.launch --nproc "$DIGEST_NPROC" $SHARE \
            --timeout "$(cap 180)" "$ROOT/tests/gpu/reliability_worker.py" $wflags "${WB[@]}" )
        grep -ohE "DIGEST [0-9]+ [0-9]+ [0-9a-f]+" "$D/digest_${sh}_$who.log" | sort > "$D/digest_${sh}_$who.txt"
      done
      if [ -s "$D/digest_${sh}_base.txt" ] && cmp -s "$D/digest_${sh}_base.txt" "$D/digest_${sh}_cur.txt"; then
        dig="$dig $sh:same($(wc -l < "$D/digest_${sh}_cur.txt"))"
      else
        dig="$dig $sh:DIFFERENT-or-missing"; fails=$((fails + 1))
      fi
    done
  fi
  ab_table "$D" > "$D/table.txt"
  cat "$D/table.txt" >> "$S.tables"
  LINE="base $base vs this tree: $fails failed or skipped;${dig:+ sha256 of outputs$dig}; table below"
  [ $fails = 0 ]
}
ab_table() {  # per case: both trees' rounds, the ratio of their medians, each tree's round spread
  bench_table "$1" > "$1/runs_table.txt"
  python3 - "$1" <<'PY'
import collections, glob, json, os, re, statistics, sys
d = sys.argv[1]
runs = collections.defaultdict(lambda: collections.defaultdict(list))  # case -> tree -> [(op ms)]
ok = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(d, "*_r*.json"))):
    m = re.match(r"(.+)_(base|cur)_r(\d+)\.json$", os.path.basename(path))
    try:
        doc = json.load(open(path))
        t = {op: doc["ops"][op]["time_s"]["median"] * 1e3 for op in ("dispatch", "combine")}
        ok[m.group(1)].append(bool(doc["correctness"]["passed"]))
    except Exception:
        continue
    runs[m.group(1)][m.group(2)].append(t)
print("A/B (ms, median of each run; rounds in run order): case op | base rounds | this rounds |"
      " this/base of the round medians | spread of a tree's rounds (max/min - 1)")
for case, trees in runs.items():
    for op in ("dispatch", "combine"):
        b = [r[op] for r in trees.get("base", [])]
        c = [r[op] for r in trees.get("cur", [])]
        ratio = statistics.median(c) / statistics.median(b) if b and c else float("nan")
        noise = lambda v: (max(v) / min(v) - 1) * 100 if len(v) > 1 else float("nan")
        print(f"{case:<6} {op:<8} | {' '.join(f'{v:.3f}' for v in b):<16} | "
              f"{' '.join(f'{v:.3f}' for v in c):<16} | {ratio:6.3f} | base {noise(b):4.1f}% "
              f"this {noise(c):4.1f}%  correct(all runs)={all(ok[case])}")
PY
}

step_reliability() {
  local calls=${CALLS:-10000}
  box 300 "$D/run.log" "${LAUNCH[@]}" 8 --timeout "$(cap 290)" tests/gpu/reliability_worker.py --calls "$calls" \
    --delay_ms 4 --sample_every 500 --max_seconds "$(( $(cap 290) > 150 ? $(cap 290) - 90 : 60 ))" "${WB[@]}" ${DRY_SHAPE:-}
  local rc=$?
  grep -hE "RELIABILITY|HANG|ERROR [0-9]|CONFIG|SETUP" "$D/run.log" | sed 's/^\[rank [0-9]*\] //' > "$D/results.txt"
  local n_ok n_mis n_hang
  n_ok=$(grep -cE "SUMMARY [0-9]+ ok" "$D/run.log")
  n_mis=$(grep -ohE "(checksum|bitwise)_mismatches=[0-9]+" "$D/results.txt" | awk -F= '{s+=$2} END {print s+0}')
  n_hang=$(grep -ohE "hangs=[0-9]+" "$D/results.txt" | awk -F= '{s+=$2} END {print s+0}')
  LINE="rc=$rc: $n_ok/8 ranks ok, mismatches $n_mis, hangs $n_hang; rank 0: $(grep -m1 'rank=0 ' "$D/results.txt" | grep -oE 'calls=[^ ]+|bitwise_checked=[^ ]+|ms_per_call=[^ ]+|call_ms_max=[^ ]+|note=.*' | paste -sd' ')"
  [ $rc = 0 ] && [ "$n_ok" = 8 ]
}

step_sanitize() {
  local tool setup mode fails=0 res=""
  local small="--calls 2 --delay_ms 0 --inputs 2 --tokens 64 --hidden 256 --topk 4 --experts_per_rank 4 --timeout_s 120"
  # Our own MPS daemon, outside the sanitizer (jaxep.launch reuses a running one).
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/jaxep-san-mps CUDA_MPS_LOG_DIRECTORY=/tmp/jaxep-san-mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d > "$D/mps_start.log" 2>&1; sleep 1
  local mps=yes
  for tool in ${TOOLS:-memcheck racecheck synccheck}; do
    for setup in ${SETUPS:-ep1 r2}; do
      for mode in ${MODES:-normal low_latency}; do
        local tag="${tool}_${setup}_$mode" log="$D/${tool}_${setup}_$mode.log"
        [ "$(cap 60)" -lt 30 ] && { res="$res $tag:skipped(time)"; continue; }
        local san=(compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 ${SANITIZE_FLAGS:-})
        # XLA's autotuning under the sanitizer would take minutes: off.
        if [ "$setup" = ep1 ]; then
          # shellcheck disable=SC2086
          XLA_FLAGS="--xla_gpu_autotune_level=0" box 150 "$log" "${san[@]}" python3 tests/gpu/reliability_worker.py --mode "$mode" $small
        elif [ $mps = yes ]; then
          # shellcheck disable=SC2086
          XLA_FLAGS="--xla_gpu_autotune_level=0" box 200 "$log" "${san[@]}" python3 -m jaxep.launch --nproc 2 --share-gpu \
            --timeout "$(cap 190)" tests/gpu/reliability_worker.py --mode "$mode" $small
          if ! grep -q "SUMMARY 0 ok" "$log" && grep -qiE "not supported|unsupported" "$log"; then
            mps=no; echo "$tag: the sanitizer under MPS failed (see ${tag}_mps.log); 2 ranks time-sliced from now on" >> "$D/notes.txt"
            mv "$log" "$D/${tag}_mps.log"
            echo quit | nvidia-cuda-mps-control > /dev/null 2>&1; sleep 1
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
          fi
        fi
        if [ "$setup" = r2 ] && [ $mps = no ]; then
          # shellcheck disable=SC2086
          XLA_FLAGS="--xla_gpu_autotune_level=0" CUDA_VISIBLE_DEVICES=0,0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
            NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_DISABLE_NCCL=1 \
            box 200 "$log" "${san[@]}" python3 -m jaxep.launch --nproc 2 --timeout "$(cap 190)" \
            tests/gpu/reliability_worker.py --mode "$mode" $small
        fi
        local errs ok
        errs=$(grep -ohE "(ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard)" "$log" | grep -oE "[0-9]+" | awk '{s+=$1} END {print s+0}')
        ok=$(grep -cE "SUMMARY [0-9]+ ok" "$log")
        local want=1; [ "$setup" = r2 ] && want=2
        res="$res $tag:${errs}err,$ok/${want}ok"
        if [ "$errs" != 0 ] || [ "$ok" != "$want" ]; then fails=$((fails + 1)); fi
      done
    done
  done
  [ $mps = yes ] && echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  LINE="$fails of the runs with errors or failures (2 ranks $( [ $mps = yes ] && echo under MPS || echo time-sliced)):$res"
  [ $fails = 0 ]
}

step_ranks() {
  local spec n g res="" fails=0
  # Small shapes; every call bitwise against the oracle. Each rank's XLA pool small: 48 ranks share
  # the GPU with their NVSHMEM heaps and contexts.
  for spec in ${LAYOUTS:-32:8 32:32 48:8}; do  # NPROC:RANKS_PER_NODE
    n=${spec%%:*}; g=${spec##*:}
    local tag="r${n}_$((n / g))x$g"
    [ "$(cap 100)" -lt 60 ] && { res="$res $tag:skipped(time)"; continue; }
    XLA_PYTHON_CLIENT_MEM_FRACTION=${RANKS_MEM_FRACTION:-0.01} \
      NVSHMEM_SYMMETRIC_SIZE=${RANKS_HEAP:-536870912} box 200 "$D/$tag.log" "${LAUNCH[@]}" "$n" --timeout "$(cap 190)" \
      tests/gpu/reliability_worker.py --calls 12 --delay_ms 1 --sample_every 1 --inputs 3 \
      --tokens 32 --hidden 256 --topk 4 --experts_per_rank 2 --ranks_per_node "$g" --timeout_s 60 "${WB[@]}"
    local rc=$? ok
    ok=$(grep -cE "SUMMARY [0-9]+ ok" "$D/$tag.log")
    if grep -qE "at most [0-9]+ ranks" "$D/$tag.log"; then
      res="$res $tag:REFUSED($(grep -ohE 'at most [0-9]+ ranks[^,;]*' "$D/$tag.log" | head -1))"
    else
      res="$res $tag:rc=$rc,$ok/${n}ok"
    fi
    [ "$ok" = "$n" ] || fails=$((fails + 1))
  done
  LINE="$fails layouts failed:$res"
  [ $fails = 0 ]
}

step_cmdbuf() {
  local cand=(); [ -n "${CMDBUF_CANDIDATES:-}" ] && cand=(--candidates "$CMDBUF_CANDIDATES")
  NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-2147483648} box 300 "$D/r8.log" "${LAUNCH[@]}" 8 --timeout "$(cap 290)" tests/gpu/cmdbuf_worker.py "${WB[@]}" "${cand[@]}" ${DRY_SHAPE_CMDBUF:-}
  local rc8=$?
  box 170 "$D/ep1.log" python3 tests/gpu/cmdbuf_worker.py "${WB[@]}" "${cand[@]}" ${DRY_SHAPE_CMDBUF:-}
  local rc1=$?
  grep -hE "CMDBUF|HLO|CONFIG|NOTE|FAIL|SKIP" "$D/r8.log" "$D/ep1.log" | sed 's/^\[rank [0-9]*\] //' > "$D/results.txt"
  local m8 m1
  m8=$(grep -m1 "CMDBUF summary" "$D/r8.log" | sed 's/.*CMDBUF summary: //')
  m1=$(grep -m1 "CMDBUF summary" "$D/ep1.log" | sed 's/.*CMDBUF summary: //')
  LINE="8 ranks rc=$rc8: ${m8:-no summary}; EP 1 rc=$rc1: ${m1:-no summary}"
  [ $rc8 = 0 ] && [ $rc1 = 0 ]
}

step_hosts() {
  # Two "hosts" on the one GPU: two `jaxep.launch --nnodes 2` launchers of 2 ranks each, node 1's
  # in a mount namespace with another kernel boot id (another host for jaxep, the same one for
  # NVSHMEM, which hashes the hostname, so P2P reaches every PE): every case of
  # tests/gpu/multirank_worker.py bitwise on both. Then one host with NVSHMEM's bootstrap pinned
  # to an interface that does not exist: every rank must fail fast, naming it. Needs root and
  # unshare(1); every rank shares one MPS daemon started here.
  local ip port boot=/tmp/jaxep-hosts-boot_id id=/proc/sys/kernel/random/boot_id
  ip=$(python3 -c "
import psutil, socket
print(next(a.address for v in psutil.net_if_addrs().values() for a in v
           if a.family == socket.AF_INET and not a.address.startswith('127.')))" 2>/dev/null)
  [ -z "$ip" ] && { LINE="no non-loopback IPv4 address"; return 1; }
  port=$(python3 -c "import socket; s=socket.socket(); s.bind(('',0)); print(s.getsockname()[1])")
  echo "0b0b0b0b-1111-2222-3333-444455556666" > "$boot"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/jaxep-hosts-mps CUDA_MPS_LOG_DIRECTORY=/tmp/jaxep-hosts-mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d > "$D/mps_start.log" 2>&1; sleep 1
  local w="tests/gpu/multirank_worker.py --case all --timeout_s 30"
  local l="python3 -m jaxep.launch --nnodes 2 --nproc 2 --coordinator $ip:$port --timeout $(cap 150) --node_rank"
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 NVSHMEM_DISABLE_NCCL=1 \
    NVSHMEM_REMOTE_TRANSPORT=none CUDA_VISIBLE_DEVICES=0,0
  # shellcheck disable=SC2086
  box 180 "$D/node0.log" $l 0 $w &
  local p0=$!
  box 180 "$D/node1.log" unshare -m sh -c "mount --bind $boot $id && cat $id && exec $l 1 $w"
  local rc1=$? rc0=0
  wait $p0 || rc0=$?
  unset CUDA_VISIBLE_DEVICES CUDA_MPS_ACTIVE_THREAD_PERCENTAGE XLA_PYTHON_CLIENT_MEM_FRACTION
  # shellcheck disable=SC2086
  NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME==nosuch0 box 130 "$D/bad_interface.log" "${LAUNCH[@]}" 2 \
    --timeout "$(cap 110)" $w
  local rcc=$?
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY NVSHMEM_DISABLE_NCCL NVSHMEM_REMOTE_TRANSPORT
  local ok0 ok1 named
  ok0=$(grep -cE "SUMMARY [0-9]+ ([0-9]+)/\1" "$D/node0.log"); ok1=$(grep -cE "SUMMARY [0-9]+ ([0-9]+)/\1" "$D/node1.log")
  named=$(grep -c "nosuch0" "$D/bad_interface.log")
  LINE="two hosts: node 0 rc=$rc0 ($ok0/2 ranks all ok), node 1 rc=$rc1 ($ok1/2); bad interface rc=$rcc (expected != 0), nosuch0 named $named times"
  [ $rc0 = 0 ] && [ $rc1 = 0 ] && [ "$ok0" = 2 ] && [ "$ok1" = 2 ] && [ $rcc != 0 ] && [ "$named" -gt 0 ]
}

# ------------------------------------------------------------------------------ main
STEPS=(); AB_BASE=""
while [ $# -gt 0 ]; do
  case $1 in
    tier) STEPS+=(tier-ep1 tier-mr1 tier-mr2 tier-nn);;  # its parts, each its own pytest process
    tier-mr) STEPS+=(tier-mr1 tier-mr2);;
    build|tier-ep1|tier-mr1|tier-mr2|tier-nn|bench|reliability|sanitize|ranks|cmdbuf|hosts) STEPS+=("$1");;
    ab) AB_BASE=${2:-}; [ -z "$AB_BASE" ] && { echo "ab needs a BASE commit: tools/gpu.sh ab 205b90b" >&2; exit 2; }
        STEPS+=(ab); shift;;
    *) echo "unknown step '$1' (tools/gpu.sh help)" >&2; exit 2;;
  esac
  shift
done
# Each step's minimum time to start (s) and cap.
declare -A MIN=([build]=60 [tier-ep1]=60 [tier-mr1]=120 [tier-mr2]=120 [tier-nn]=90 [bench]=60 [ab]=150
                [reliability]=90 [sanitize]=60 [ranks]=90 [cmdbuf]=90 [hosts]=120)
declare -A CAP=([build]=240 [tier-ep1]=200 [tier-mr1]=300 [tier-mr2]=300 [tier-nn]=240 [bench]=540 [ab]=560
                [reliability]=300 [sanitize]=560 [ranks]=540 [cmdbuf]=480 [hosts]=330)

{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | head -2
  python3 -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())" 2>&1 | tail -1
  # The device tool copies the working tree without this checkout's .git (a .git there may be
  # another commit's): the caller names the tree's commit, GPU_TREE=$(git rev-parse --short HEAD).
  echo "tree $ROOT at ${GPU_TREE:-an unnamed commit (set GPU_TREE)}, steps: ${STEPS[*]}${AB_BASE:+ (ab base $AB_BASE)}"
} | tee -a "$S"
: > "$S.tables"
FAILED=0
for st in "${STEPS[@]}"; do
  D="$OUT/$st"; rm -rf "$D"; mkdir -p "$D"; : > "$D/commands.txt"
  l=$(left)
  if [ "$l" -lt "${MIN[$st]}" ]; then
    printf '%-12s %-15s %5ss  %s\n' "$st" "skipped (time)" 0 "needs ${MIN[$st]}s, ${l}s left" >> "$ROWS"
    rm -rf "$D"; continue
  fi
  STEP_END=$(( $(now) + (CAP[$st] < l ? CAP[$st] : l) ))
  t=$(now); LINE=""
  echo "=== $st (until +$(( STEP_END - t ))s)"
  "step_${st//-/_}"; rc=$?
  status=ok; [ $rc != 0 ] && { status=FAIL; FAILED=1; }
  [ "$(now)" -ge "$STEP_END" ] && status="$status (time box)"
  say "$st: $status in $(( $(now) - t ))s: $LINE"
  printf '%-12s %-15s %5ss  %s\n' "$st" "$status" "$(( $(now) - t ))" "$(echo "$LINE" | cut -c1-140)" >> "$ROWS"
  tar czf "$OUT/$st.tgz" -C "$OUT" "$st" && rm -rf "$D"
done
{
  [ -s "$S.tables" ] && cat "$S.tables"
  echo "--- steps (logs: \$OUT/<step>.tgz) ---"
  cat "$ROWS"
  echo "total $(( $(now) - T0 ))s of ${TIME_LIMIT}s"
} >> "$S"
rm -f "$S.tables" "$ROWS"
echo; echo "================ summary"; cat "$S"
exit $FAILED

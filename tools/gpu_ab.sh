#!/usr/bin/env bash
# Same-run A/B of the benchmark between an older tree (BEFORE, a `git archive` tarball) and this
# working tree (AFTER), in one device call, so both binaries meet the same GPU state:
#   git archive -o .ab/before.tar <commit> ffi jaxep tools tests CMakeLists.txt pyproject.toml
#   (device) OUT=... [SETUPS="8:64 4:64"] [ROUNDS=2] [AFTER_TAR=.ab/after.tar] \
#            [VARIANTS="--tokens 128 -- --mode=low_latency|--tokens 1 -- --mode=low_latency"] \
#            [AFTER_CMD="python3 -m pytest ... "] bash tools/gpu_ab.sh
#   (carry: .ab; AFTER_TAR: a `git archive` of the commit to test instead of the working tree;
#   VARIANTS: '|'-separated extra flags of tools/bench_multirank.py, each run for every setup and
#   round (default: one variant, AB_EXTRA); AFTER_CMD: run once in the AFTER tree after the A/B
#   (e.g. the GPU tier's low-latency cases), its output in logs/after_cmd.log; MORE="tag:.ab/x.tar
#   ...": further trees, each unpacked, built and run like BEFORE right after it, tagged `tag`)
# Each tree is built with CMake into its own build/ and its module copied next to its jaxep/ (no
# pip install: an editable install of one tree would shadow the other); every run imports its own
# tree through PYTHONPATH. For each round and setup N:E, the BEFORE and AFTER benches run back to
# back (tools/bench_multirank.py of each tree: correctness checked bitwise first, then timed).
# Output: $OUT/ab_summary.txt (the rows of every run, printed last) and $OUT/ab_logs.tar.gz.
# CPU dry run (no GPU; the reference backend on 2 CPU processes; BUILD=0 uses modules already
# copied next to each jaxep/):
#   JAX_PLATFORMS=cpu AB_EXTRA="--backend reference --no-share-gpu --tokens 16 --hidden 32
#   --topk 2" SETUPS="2:8" ROUNDS=1 OUT=/tmp/ab bash tools/gpu_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/jaxep_ab}; mkdir -p "$OUT/logs"
L="$OUT/logs"
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 JAXEP_LOG_LEVEL=INFO
SETUPS=${SETUPS:-"8:64 4:64"}
ROUNDS=${ROUNDS:-2}
unpack() {  # tarball dir
  rm -rf "$2" && mkdir -p "$2" && tar xf "$1" -C "$2"
}
# The trees other than AFTER, in run order: BEFORE, then MORE's.
TAGS=(); DIRS=()
for m in before:.ab/before.tar ${MORE:-}; do  # tag:tarball
  TAGS+=("${m%%:*}"); DIRS+=("/tmp/jaxep_${m%%:*}")
  unpack "${m#*:}" "/tmp/jaxep_${m%%:*}" || exit 3
done
AFTER=$(pwd)
if [ -n "${AFTER_TAR:-}" ]; then  # AFTER_TAR=.ab/after.tar: a committed tree instead of this one
  AFTER=/tmp/jaxep_after
  unpack "$AFTER_TAR" "$AFTER" || exit 3
fi
T0=$(date +%s)

build() {  # tree tag
  local py; py=$(command -v python3)
  cmake -S "$1" -B "$1/build" -G Ninja -DPython_EXECUTABLE="$py" -DJAXEP_REQUIRE_CUDA=ON \
    > "$L/build_$2.log" 2>&1 && cmake --build "$1/build" -j 8 >> "$L/build_$2.log" 2>&1 \
    && cp "$1"/build/_jaxep_cuda*.so "$1/jaxep/" \
    && (cd "$1" && PYTHONPATH="$1" python3 -c "import jaxep._ffi as f; print('$2 extension', f.is_available(), f.unavailable_reason(), f.build_info().get('multi_rank'))")
}
if [ "${BUILD:-1}" = 1 ]; then
  for i in "${!TAGS[@]}"; do
    build "${DIRS[$i]}" "${TAGS[$i]}" > "$L/import_${TAGS[$i]}.txt" 2>&1 &
  done
  build "$AFTER" after > "$L/import_after.txt" 2>&1
  wait
else
  for d in "${DIRS[@]}"; do cp "$AFTER"/jaxep/_jaxep_cuda*.so "$d/jaxep/" 2>/dev/null || true; done
fi
cat "$L"/import_*.txt | grep extension
echo "builds done in $(( $(date +%s) - T0 ))s"

run() {  # tree tag nproc experts round variant-index variant-flags
  local d="$L/$2_n$3_e$4_v$6_r$5"; mkdir -p "$d"
  echo "$7" > "$d/variant.txt"
  # shellcheck disable=SC2086  # the flags are words
  ( cd "$1" && PYTHONPATH="$1" timeout -k 10 170 python3 tools/bench_multirank.py --nproc "$3" \
      --experts "$4" --iters 10 --timeout 150 --outdir "$d" --summary_json "$d/rows.json" --no-plot $7 \
      > "$d/stdout.txt" 2>&1 )
  echo "$2 N=$3 E=$4 v$6 round $5: rc=$? ($(( $(date +%s) - T0 ))s)"
}
IFS='|' read -r -a VARS <<< "${VARIANTS:-${AB_EXTRA:-}}"
[ "${#VARS[@]}" -eq 0 ] && VARS=("")
for r in $(seq 1 "$ROUNDS"); do
  for s in $SETUPS; do
    n=${s%%:*}; e=${s##*:}
    for v in "${!VARS[@]}"; do
      for i in "${!TAGS[@]}"; do
        run "${DIRS[$i]}" "${TAGS[$i]}" "$n" "$e" "$r" "$v" "${VARS[$v]}"
      done
      run "$AFTER" after "$n" "$e" "$r" "$v" "${VARS[$v]}"
    done
  done
done
if [ -n "${AFTER_CMD:-}" ]; then  # once, in the AFTER tree (its own build on PYTHONPATH)
  ( cd "$AFTER" && PYTHONPATH="$AFTER" bash -c "$AFTER_CMD" ) > "$L/after_cmd.log" 2>&1
  echo "AFTER_CMD rc=$? ($(( $(date +%s) - T0 ))s): $(tail -1 "$L/after_cmd.log" | cut -c1-150)"
fi
{
  echo "--- A/B rows (tree, N, E, variant, round): dispatch/combine ms, payload copy ms, pc/op = copy / op ---"
  python3 - "$L" <<'PY'
import glob, json, os, sys
L = sys.argv[1]
for path in sorted(glob.glob(os.path.join(L, "*_n*_e*_r*", "rows.json")),
                   key=lambda p: os.path.basename(os.path.dirname(p)).split("_")[1:] +
                   os.path.basename(os.path.dirname(p)).split("_")[:1]):  # variant, round, tree
    d = os.path.dirname(path)
    tag = os.path.basename(d)
    for r in json.load(open(path)):
        if "ok" not in r:
            print(f"{tag:<24} no JSON rc={r['rc']}")
            continue
        line = (f"{tag:<24} ok={r['ok']} disp {r['dispatch_ms']:.3f} comb {r['combine_ms']:.3f} "
                f"both {r['both_ms']:.3f} pcopy {r['payload_copy_ms']:.3f} "
                f"d pc/op {r['dispatch_payload_copy_over_op']:.2f} "
                f"c pc/op {r['combine_payload_copy_over_op']:.2f} "
                f"h/op {r['dispatch_handler_runs']},{r['combine_handler_runs']}")
        for j in glob.glob(os.path.join(d, "*low-latency*.json")):  # the LL bench's own figures
            ll = json.load(open(j)).get("low_latency", {})
            if ll:
                line += (f" | LL T={ll['tokens']} fp8={ll['fp8_dispatch']} x_copy/disp "
                         f"{ll['x_copy_over_dispatch']:.2f} x_copy {ll['x_copy_s']['median'] * 1e6:.0f}us "
                         f"signal {(ll.get('signal_round_trip_s') or {}).get('median', 0) * 1e6:.0f}us")
        print(line)
for v in sorted(glob.glob(os.path.join(L, "after_n*_v*_r1", "variant.txt"))):
    print(os.path.basename(os.path.dirname(v)).split("_r")[0].replace("after_", ""), "flags:",
          open(v).read().strip() or "(none)")
PY
  echo "total $(( $(date +%s) - T0 ))s"
} > "$OUT/ab_summary.txt" 2>&1
tar czf "$OUT/ab_logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
cat "$OUT/ab_summary.txt"

#!/usr/bin/env bash
# One device call: build the extension, run the GPU tier, the benchmark and the example on one GPU.
# Logs land in $OUT (the device tool brings them back). Usage on the GPU machine: tools/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/jaxep_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
summary() { echo "$1" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
t0=$(date +%s)
JAXEP_CUDA=13 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; summary "build rc=$? ($(( $(date +%s)-t0 ))s)"
python3 -c "import jaxep._ffi as f; print(f.is_available(), f.unavailable_reason(), f.build_info())" >> "$OUT/build.log" 2>&1
timeout 240 python3 -m pytest -q tests/gpu -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; summary "gpu tier rc=$? : $(tail -1 "$OUT/gpu_tests.log")"
for E in 64 256; do
  timeout 150 python3 -m jaxep.bench --backend cuda --tokens 4096 --hidden 7168 --topk 8 --experts $E \
    --dtype bfloat16 --iters 10 --json "$OUT/bench_e$E.json" --plot "$OUT/bench_e$E.png" > "$OUT/bench_e$E.log" 2>&1
  summary "bench E=$E rc=$?"; grep -E "^(op|dispatch|combine|both|correctness|copy)" "$OUT/bench_e$E.log" | head -8 | tee -a "$OUT/summary.txt"
done
for B in cuda reference; do
  timeout 100 python3 examples/moe_flax.py --backend $B --ep 1 --dtype bfloat16 --steps 80 --batch 64 --seq_len 64 \
    --d_model 256 --ffn 512 --experts 16 > "$OUT/example_$B.log" 2>&1
  summary "example $B rc=$? : $(grep -iE 'tokens/s' "$OUT/example_$B.log" | tail -2 | tr '\n' ' ')"
done
python3 -m jaxep.doctor > "$OUT/doctor.log" 2>&1; summary "doctor rc=$?"
cat "$OUT/summary.txt"

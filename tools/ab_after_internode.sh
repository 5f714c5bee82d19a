#!/usr/bin/env bash
# AFTER_CMD for tools/gpu_ab.sh when the A/B changes the internode path (session 11, call 2):
#   AFTER_CMD="bash tools/ab_after_internode.sh" bash tools/gpu_ab.sh
# Runs from the AFTER tree, on the modules gpu_ab.sh built (BUILD=0), tools/gpu_next.sh's own
# steps: `mrn` (every node layout and both killed-peer cases, ~125 s) and `phase8_64g4` (the 2x4
# bf16-wire phase table, ~30 s) here, then `phase8_64g4` in the BEFORE tree (/tmp/jaxep_before,
# unpacked by gpu_ab.sh). Each summary (phase table included) prints; logs in $OUT/{after,before}_steps.
set -uo pipefail
OUT=${OUT:-/tmp/jaxep_ab}
BUILD=0 STEPS="mrn phase8_64g4" OUT="$OUT/after_steps" bash tools/gpu_next.sh
(cd /tmp/jaxep_before && PYTHONPATH=/tmp/jaxep_before BUILD=0 STEPS="phase8_64g4" \
  OUT="$OUT/before_steps" bash tools/gpu_next.sh)

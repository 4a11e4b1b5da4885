#!/usr/bin/env bash
# One-GPU device check, within 8 minutes: every step runs (a failure never stops the rest), each under its own
# timeout and the global deadline, and a summary table closes the run. Exit 0 only when every step passed.
#
#   scripts/device_check.sh                     # on a host with one CUDA GPU
#   DEVICE_CHECK_DRY=1 scripts/device_check.sh  # the same steps on the CPU with tiny sizes (CI rehearsal)
#
# Environment: PYTHON (default: .venv/bin/python, else python), DEVICE_CHECK_OUT (default out/device-check),
# DEVICE_CHECK_BUDGET_S (default 480).
#
# Steps: CUDA present; single-rank qualify in fp32 and in bf16 (tiny base, transformers oracle); the GPU-marked
# tests a single GPU can run (test_gpu.py's layouts need >= 2 ranks and report their skips; a quantized base loaded
# on the GPU has the CPU load's bits); the device-sensitive
# suites (placement audit, bf16 vs the fp32 oracle, activation memory) on the GPU; the memory of one
# Flash-width layer with LoRA against impl's memory model; the Flash layer-share load benchmark.
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python; fi
fi
DRY="${DEVICE_CHECK_DRY:-0}"
OUT="${DEVICE_CHECK_OUT:-out/device-check}"
BUDGET_S="${DEVICE_CHECK_BUDGET_S:-480}"
mkdir -p "$OUT"
DEADLINE=$((SECONDS + BUDGET_S))
NAMES=() RESULTS=() TIMES=() LOGS=()

# run NAME BUDGET_S COMMAND...: log to $OUT/NAME.log, record PASS / FAIL (rc) / TIMEOUT / SKIP (no time left)
run() {
  local name="$1" budget="$2"
  shift 2
  local left=$((DEADLINE - SECONDS - 5)) log="$OUT/$name.log" start=$SECONDS rc
  [ "$budget" -gt "$left" ] && budget="$left"
  NAMES+=("$name") LOGS+=("$log")
  if [ "$budget" -lt 10 ]; then
    RESULTS+=("SKIP (budget spent)") TIMES+=(0)
    echo "== $name: skipped, the ${BUDGET_S}s budget is spent"
    return 0
  fi
  echo "== $name (timeout ${budget}s): $*"
  timeout --kill-after=10 "$budget" "$@" >"$log" 2>&1
  rc=$?
  TIMES+=($((SECONDS - start)))
  case "$rc" in
    0) RESULTS+=("PASS") ;;
    124 | 137) RESULTS+=("TIMEOUT") ;;
    *) RESULTS+=("FAIL (rc $rc)") ;;
  esac
  echo "   ${RESULTS[-1]} in ${TIMES[-1]}s; last lines of $log:"
  tail -n 4 "$log" | sed 's/^/   | /'
  return 0
}

if [ "$DRY" = "1" ]; then
  echo "device check: DRY RUN on the CPU (tiny sizes), budget ${BUDGET_S}s, logs in $OUT"
  run cuda-present 30 "$PYTHON" -c 'import torch; print("dry run: CUDA not required; available =", torch.cuda.is_available())'
  LAYER_ARGS=(--tiny)
else
  echo "device check on one GPU, budget ${BUDGET_S}s, logs in $OUT"
  run cuda-present 30 "$PYTHON" -c 'import torch, sys; ok = torch.cuda.is_available(); print("cuda", ok, torch.cuda.get_device_name(0) if ok else "-", "devices", torch.cuda.device_count()); sys.exit(0 if ok else 1)'
  LAYER_ARGS=(--seq 4096)
fi

run qualify-fp32 120 "$PYTHON" -m impl.cli qualify --preset tiny-mixed --out "$OUT/qualify-fp32" --timeout 100
run qualify-bf16 120 "$PYTHON" -m impl.cli qualify --preset tiny-mixed --out "$OUT/qualify-bf16" --timeout 100 \
  --dtype bfloat16
run gpu-marked-1gpu 60 "$PYTHON" -m pytest -p no:cacheprovider -q -rs -m gpu --nproc 1 suites/test_gpu.py suites/test_gpu_quantized_load.py
# (qualify in bf16 already ran above: its slow suite twin is left out)
run device-suites 240 "$PYTHON" -m pytest -p no:cacheprovider -q -n 0 -m "cpu and not slow" \
  suites/test_device_placement.py suites/test_bf16.py suites/test_activation_memory.py
run layer-memory 90 "$PYTHON" scripts/layer_memory.py "${LAYER_ARGS[@]}"
run load-bench 120 "$PYTHON" -m pytest -p no:cacheprovider -q -s -n 0 -m bench suites/test_bench_load.py

echo
printf '%-18s %-20s %6s  %s\n' step result seconds log
failed=0
for i in "${!NAMES[@]}"; do
  printf '%-18s %-20s %6s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}" "${LOGS[$i]}"
  [ "${RESULTS[$i]}" = "PASS" ] || failed=$((failed + 1))
done
echo "total ${SECONDS}s of ${BUDGET_S}s budget; ${failed} step(s) not passed"
exit $((failed > 0))

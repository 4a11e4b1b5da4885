#!/usr/bin/env bash
# One-GPU device check, within 5 minutes (so one rerun fits the device lease): every step runs (a failure never stops
# the rest), each under its own timeout and the global deadline, and a summary table closes the run. Exit 0 only
# when every step passed.
#
#   scripts/device_bundle.sh                    # here, with network: the wheels the GPU image lacks
#   scripts/device_check.sh                     # there: installs the bundle offline, then runs every step
#   DEVICE_CHECK_DRY=1 scripts/device_check.sh  # the same steps on the CPU with tiny sizes (CI rehearsal:
#                                               # scripts/device_rehearsal.sh, the image's versions, no network)
#
# Environment: PYTHON (default: .venv/bin/python, else python3: the image's own), DEVICE_BUNDLE (default
# .device-bundle; installed with pip --no-index --no-deps --target DEVICE_SITE, default /tmp/dsv4-device-site,
# when it exists), DEVICE_CHECK_OUT (default out/device-check), DEVICE_CHECK_BUDGET_S (default 300).
#
# Steps: the bundle installed offline; the versions in use; CUDA present; single-rank qualify in fp32 and in bf16
# (tiny base, transformers oracle); the GPU-marked tests a single GPU can run (test_gpu.py's layouts need >= 2
# ranks and report their skips; a quantized base loaded on the GPU has the CPU load's bits); the device-sensitive
# suites (placement audit, bf16 vs the fp32 oracle, activation memory) on the GPU; the memory of one Flash-width
# layer with LoRA against impl's memory model; the Flash layer-share load benchmark.
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
DRY="${DEVICE_CHECK_DRY:-0}"
OUT="${DEVICE_CHECK_OUT:-out/device-check}"
BUDGET_S="${DEVICE_CHECK_BUDGET_S:-300}"
BUNDLE="${DEVICE_BUNDLE:-$REPO/.device-bundle}"
SITE="${DEVICE_SITE:-/tmp/dsv4-device-site}"
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

if [ "$DRY" = "1" ]; then WHAT="DRY RUN on the CPU (tiny sizes)"; else WHAT="on one GPU"; fi
echo "device check $WHAT, budget ${BUDGET_S}s, logs in $OUT"
# The bundle first: every later step imports megatron from it. Offline by construction (--no-index), and quick.
if [ -d "$BUNDLE/wheels" ]; then
  run install-bundle 60 "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/wheels/*.whl
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
  # compiled once, or every later step's interpreters and ranks compile megatron again
  run compile-bundle 60 "$REPO/scripts/byte_compile.sh" "$PYTHON" "$SITE"
fi
run versions 30 "$PYTHON" -c 'import importlib.metadata as m, sys
names = ("torch", "transformers", "peft", "safetensors", "megatron-core", "megatron-bridge", "omegaconf")
found = {}
for d in names:
    try:
        found[d] = m.version(d)
    except m.PackageNotFoundError:
        found[d] = "ABSENT"
print(f"python {sys.version.split()[0]}; " + ", ".join(f"{d} {v}" for d, v in found.items()))
sys.exit("ABSENT" in found.values())'

if [ "$DRY" = "1" ]; then
  run cuda-present 30 "$PYTHON" -c 'import torch; print("dry run: CUDA not required; available =", torch.cuda.is_available())'
  LAYER_ARGS=(--tiny)
else
  run cuda-present 30 "$PYTHON" -c 'import torch, sys; ok = torch.cuda.is_available(); print("cuda", ok, torch.cuda.get_device_name(0) if ok else "-", "devices", torch.cuda.device_count()); sys.exit(0 if ok else 1)'
  LAYER_ARGS=(--seq 4096)
fi

run qualify-fp32 120 "$PYTHON" -m impl.cli qualify --preset tiny-mixed --out "$OUT/qualify-fp32" --timeout 100
run qualify-bf16 120 "$PYTHON" -m impl.cli qualify --preset tiny-mixed --out "$OUT/qualify-bf16" --timeout 100 \
  --dtype bfloat16
run gpu-marked-1gpu 60 "$PYTHON" -m pytest -p no:cacheprovider -q -rs -m gpu --nproc 1 suites/reference/test_gpu.py suites/reference/test_gpu_quantized_load.py
# (qualify in bf16 already ran above: its slow suite twin is left out)
run device-suites 240 "$PYTHON" -m pytest -p no:cacheprovider -q -n 0 -m "cpu and not slow" \
  suites/reference/test_device_placement.py suites/reference/test_bf16.py suites/reference/test_activation_memory.py
run layer-memory 90 "$PYTHON" scripts/layer_memory.py "${LAYER_ARGS[@]}"
run load-bench 120 "$PYTHON" -m pytest -p no:cacheprovider -q -s -n 0 -m bench suites/reference/test_bench_load.py

echo
printf '%-18s %-20s %6s  %s\n' step result seconds log
failed=0
for i in "${!NAMES[@]}"; do
  printf '%-18s %-20s %6s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${TIMES[$i]}" "${LOGS[$i]}"
  [ "${RESULTS[$i]}" = "PASS" ] || failed=$((failed + 1))
done
echo "total ${SECONDS}s of ${BUDGET_S}s budget; ${failed} step(s) not passed"
exit $((failed > 0))

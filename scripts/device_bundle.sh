#!/usr/bin/env bash
# Put into one ignored folder what scripts/device_check.sh needs on the lent GPU machine and its image lacks, and
# print how to run the check there. That machine has no network and a fixed image (Python 3.12, torch, transformers,
# peft, safetensors, einops, the test tools: requirements/device-image.txt); what it lacks travels as wheels, with
# the working tree, in at most 64 MiB.
#   scripts/device_bundle.sh [DIR]        default DIR=.device-bundle (ignored by git)
# The wheels: megatron-core and omegaconf as requirements/base.txt pins them, megatron-bridge as scripts/install.sh
# pins it (installed there with --no-deps, as here), and omegaconf's antlr4 runtime. scripts/device_check.sh
# installs them offline (--no-index --no-deps --target) before its first step.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device-bundle}
BRIDGE_PIN=${BRIDGE_PIN:-0.6.2}
LIMIT_MIB=64

pin() {  # the version requirements/base.txt pins for package $1
  sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements/base.txt | head -n 1
}
WHEELS=("megatron-core==$(pin megatron-core)" "megatron-bridge==$BRIDGE_PIN" "omegaconf==$(pin omegaconf)"
  "antlr4-python3-runtime==4.9.3")
for w in "${WHEELS[@]}"; do
  case "$w" in *==) echo "device_bundle: no pin for ${w%==} in requirements/base.txt" >&2; exit 1 ;; esac
done

PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
rm -rf "$DIR"
mkdir -p "$DIR/wheels"
# pip wheel: binary wheels as published, and a wheel built here for a source-only release (antlr4's 4.9.3)
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DIR/wheels" "${WHEELS[@]}"
printf '%s\n' "${WHEELS[@]}" >"$DIR/wheels.txt"

tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
bundle_bytes=$(du -sb "$DIR" | cut -f1)
total_mib=$(((tree_bytes + bundle_bytes + 1048575) / 1048576))
echo "bundle: $DIR ($(ls "$DIR/wheels" | wc -l) wheels, $((bundle_bytes / 1024)) KiB): $(ls "$DIR/wheels" | tr '\n' ' ')"
echo "working tree $((tree_bytes / 1024)) KiB + bundle: ${total_mib} MiB of the ${LIMIT_MIB} MiB that travel"
if [ "$total_mib" -gt "$LIMIT_MIB" ]; then
  echo "device_bundle: tree + bundle exceed ${LIMIT_MIB} MiB; nothing would travel" >&2
  exit 1
fi
echo "carry: [\"$DIR\"]"
echo "command: DEVICE_BUNDLE=$DIR scripts/device_check.sh   (timeout_s 330: the check's budget is 300 s, so a rerun fits the lease)"

#!/usr/bin/env bash
# Build (or reuse) a small per-pin overlay of megatron-bridge [+ megatron-core] and print the PYTHONPATH to use.
#   scripts/pin_overlay.sh PIN            PIN = megatron-bridge version, e.g. 0.4.2 | 0.5.1 | 0.6.2
#   PYTHONPATH=$(scripts/pin_overlay.sh 0.5.1) .venv/bin/python -m pytest ...
# Instead of one whole venv per pin, the overlay holds only the packages that differ from .venv
# (installed --no-deps into .pins/<PIN>/) and is prepended to PYTHONPATH. `megatron` is a namespace package
# (no __init__.py), so megatron.bridge / megatron.core / megatron.training resolve from the overlay first and
# everything else (torch, transformers, peft) from .venv.
# Environment: MCORE_PIN (default: the pin's megatron-core below), VENV (default .venv), PINS_DIR (default .pins).
# Progress goes to stderr; stdout is only the PYTHONPATH line.
set -euo pipefail
cd "$(dirname "$0")/.."
PIN=${1:?usage: scripts/pin_overlay.sh PIN (megatron-bridge version, e.g. 0.4.2)}
VENV=${VENV:-.venv}
PINS_DIR=${PINS_DIR:-.pins}

# The megatron-core each bridge release is meant for. 0.4.x imports megatron.training.config, which megatron-core
# first ships in 0.17 (0.16.1 has no megatron/training at all, so the overlay would fall through to .venv's 0.19.2).
default_mcore() {
  case "$1" in
    0.4.*) echo 0.17.1 ;;
    *) echo 0.19.2 ;;
  esac
}
MCORE=${MCORE_PIN:-$(default_mcore "$PIN")}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "pin_overlay: $PY missing; run scripts/install.sh first" >&2; exit 1; }
venv_version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true; }

DIR="$PINS_DIR/$PIN"
mkdir -p "$PINS_DIR"
# The overlays are build outputs: keep them out of git without touching the root .gitignore.
[ -f "$PINS_DIR/.gitignore" ] || echo '*' >"$PINS_DIR/.gitignore"

# The real packages megatron-bridge < 0.6 imports at module level that .venv lacks: auto_bridge.py does
# `from modelopt.torch.quantization.utils import is_quantized` (0.6 imports it lazily). modelopt's own import chain
# is listed explicitly because pip --target cannot reuse .venv's torch. Shared by every pin that needs it.
MODELOPT_SET=(nvidia-modelopt==0.47.0 pulp==3.3.2 scipy==1.18.1 requests==2.34.2 charset-normalizer==3.5.3
  idna==3.20 urllib3==2.8.0 certifi==2026.10.19.post1 nvidia-ml-py==13.615.71 ninja==1.13.2)

elapsed() { python3 -c "import time,sys; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$1"; }

# build_dir DIR SPEC...: (re)install SPEC into DIR unless DIR already holds exactly that SPEC.
build_dir() {
  local dir=$1 start tmp
  shift
  [ -f "$dir/.overlay-spec" ] && [ "$(cat "$dir/.overlay-spec")" = "$*" ] && return 0
  start=$(date +%s.%N)
  tmp="$dir.tmp.$$"
  rm -rf "$dir" "$tmp"
  "$PY" -m pip install --disable-pip-version-check -q --no-deps --no-compile --target "$tmp" "$@" >&2
  # compiled once, or every worker, rank and command line of a pin run compiles Megatron-Bridge again
  scripts/byte_compile.sh "$PY" "$tmp"
  echo "$*" >"$tmp/.overlay-spec"
  mv "$tmp" "$dir"
  echo "pin_overlay: built $dir ($*) in $(elapsed "$start")s, size $(du -sh "$dir" | cut -f1)" >&2
}

# Only what .venv does not already have goes into the overlay.
want=()
[ "$(venv_version megatron-bridge)" = "$PIN" ] || want+=("megatron-bridge==$PIN")
[ "$(venv_version megatron-core)" = "$MCORE" ] || want+=("megatron-core==$MCORE")
if [ ${#want[@]} -eq 0 ]; then
  echo "pin_overlay: .venv already has megatron-bridge $PIN / megatron-core $MCORE; no overlay" >&2
  echo "${PYTHONPATH:-}"
  exit 0
fi
build_dir "$DIR" "${want[@]}"
paths="$(cd "$DIR" && pwd)"
if grep -qE '^from modelopt|^import modelopt' "$DIR/megatron/bridge/models/conversion/auto_bridge.py" 2>/dev/null &&
  ! "$PY" -c 'import modelopt' 2>/dev/null; then
  build_dir "$PINS_DIR/_modelopt" "${MODELOPT_SET[@]}"
  paths="$paths:$(cd "$PINS_DIR/_modelopt" && pwd)"
fi

OVERLAY=$(cd "$DIR" && pwd)
# Fail loudly if a package would still resolve from .venv (e.g. a core without megatron.training).
PYTHONPATH="$paths${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$OVERLAY" "$PIN" "$MCORE" >&2 <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

overlay, pin, mcore = sys.argv[1:]
errors = []
if md.version("megatron-bridge") != pin:
    errors.append(f"megatron-bridge resolves to {md.version('megatron-bridge')}, expected {pin}")
if md.version("megatron-core") != mcore:
    errors.append(f"megatron-core resolves to {md.version('megatron-core')}, expected {mcore}")
core_in_overlay = str(md.distribution("megatron-core").locate_file("")).rstrip("/") == overlay
overlaid = ["megatron.bridge"] + (["megatron.core", "megatron.training"] if core_in_overlay else [])
for mod in overlaid:
    spec = importlib.util.find_spec(mod)
    origin = spec.origin if spec else None
    if not origin or not origin.startswith(overlay):
        errors.append(f"{mod} resolves to {origin}, not the overlay {overlay}")
if errors:
    sys.exit("pin_overlay: " + "; ".join(errors))
EOF
echo "$paths${PYTHONPATH:+:$PYTHONPATH}"

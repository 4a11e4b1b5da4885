#!/usr/bin/env bash
# Install the other projects whose own code judges our exported adapters (the serving engines: suites/reference/test_consumers.py)
# or produces adapters we judge (NeMo AutoModel: suites/reference/test_producer_nemo.py), each in an environment of its own:
# .consumers/<name> (ignored by git). One environment per engine release (a lane, fixtures/consumers LANES):
#   scripts/install_consumers.sh [vllm] [vllm-0.34] [sglang] [nemo-automodel]        default: all four
#   vllm: vLLM 0.33.0 (requirements/consumers-vllm.txt); vllm-0.34: vLLM 0.34.0 (requirements/consumers-vllm-0.34.txt)
# Each is Python 3.11 + requirements/{consumers,producers}-<name>.txt installed with --no-deps: the project's real wheel from
# the package index and only what its LoRA-loading and model modules import on a CPU host (not a working
# server; the full dependency sets pull CUDA builds and several GB). An environment whose requirements file is
# unchanged is reused. The main .venv is untouched.
# Sharing: a requirements file with a line '# based-on: <name>' starts from a hard-linked copy of that environment
# (built first, up to date), so the packages both files pin are the same files, stored once and not unpacked again;
# pip then installs what differs and removes what the file does not list, so the result holds exactly its file.
# Environment: DSV4_CONSUMERS_DIR (default .consumers); DSV4_TORCH_CPU_INDEX, an extra index with the CPU torch
# wheel (PyTorch's own CPU wheel index) where pip's configured find-links do not provide it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${DSV4_CONSUMERS_DIR:-.consumers}
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(vllm vllm-0.34 sglang nemo-automodel)

find_python311() {
  for cand in python3.11 "$HOME/.pyenv/versions/3.11.7/bin/python3.11" "$HOME"/.pyenv/versions/3.11.*/bin/python3.11 \
    /usr/local/bin/python3.11 /usr/bin/python3.11; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$cand"
      return 0
    fi
  done
  echo "error: Python 3.11 not found (the consumer environments use the CPU torch wheel for CPython 3.11; both" \
    "engines' wheels support it); install it, e.g. 'pyenv install 3.11'" >&2
  return 1
}

requirements_of() {  # the requirements file of an environment name
  local req="requirements/consumers-$1.txt"
  [ -f "$req" ] || req="requirements/producers-$1.txt"
  [ -f "$req" ] || { echo "error: no requirements/{consumers,producers}-$1.txt (known: vllm, vllm-0.34, sglang, nemo-automodel)" >&2; return 1; }
  echo "$req"
}

spec_of() {  # what an environment was built from: its file, and its base's (a changed base rebuilds it)
  local req base
  req=$(requirements_of "$1") || return 1
  base=$(based_on "$req")
  { cat "$req"; [ -z "$base" ] || spec_of "$base"; } | sha256sum | cut -d' ' -f1
}

based_on() { sed -n 's/^# based-on: *\([A-Za-z0-9._-]*\).*/\1/p' "$1" | head -n 1; }

normalized_names() { sed -e 's/[#;].*//' -e 's/[=<>!~ ].*//' | grep -v '^$' | tr 'A-Z_.' 'a-z--' | sort -u; }

install_one() {
  local name=$1 env="$DIR/$1" start spec req base
  req=$(requirements_of "$name") || return 1
  spec=$(spec_of "$name")
  if [ -f "$env/.consumer-spec" ] && [ "$(cat "$env/.consumer-spec")" = "$spec" ]; then
    echo "install_consumers: $env is up to date ($req unchanged)"
    return 0
  fi
  start=$(date +%s)
  rm -rf "$env"
  base=$(based_on "$req")
  if [ -n "$base" ] && [ -f "$DIR/$base/.consumer-spec" ] && [ "$(cat "$DIR/$base/.consumer-spec")" = "$(spec_of "$base")" ] &&
    cp -al "$DIR/$base" "$env" 2>/dev/null; then
    rm -f "$env/.consumer-spec"
  else
    rm -rf "$env"
    base=""
    "$PY" -m venv "$env"
  fi
  local extra=()
  [ -n "${DSV4_TORCH_CPU_INDEX:-}" ] && extra=(--extra-index-url "$DSV4_TORCH_CPU_INDEX")
  if ! "$env/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-compile "${extra[@]}" -r "$req"; then
    echo "error: installing $req failed; if torch==2.13.0+cpu was not found, set" \
      "DSV4_TORCH_CPU_INDEX=<PyTorch CPU wheel index URL>" >&2
    return 1
  fi
  if [ -n "$base" ]; then  # what the base has and this file does not list goes
    local stale
    stale=$(comm -23 <("$env/bin/python" -m pip list --disable-pip-version-check --format=freeze 2>/dev/null | normalized_names) \
      <({ normalized_names <"$req"; printf 'pip\nsetuptools\n'; } | sort -u))
    [ -z "$stale" ] || "$env/bin/python" -m pip uninstall --disable-pip-version-check -q -y $stale
  fi
  # compiled once, or every probe compiles the engine it imports again (a hard-linked copy keeps its base's files)
  scripts/byte_compile.sh "$env/bin/python" "$env/lib"
  echo "$spec" >"$env/.consumer-spec"
  echo "install_consumers: $name in $(($(date +%s) - start))s${base:+ (from a hard-linked copy of $DIR/$base)}, size $(du -sh "$env" | cut -f1)"
}

PY=$(find_python311)
mkdir -p "$DIR"
total=$(date +%s)
for name in "${NAMES[@]}"; do install_one "$name"; done
echo "install_consumers: done in $(($(date +%s) - total))s; $(du -sh "$DIR" | cut -f1) in $DIR"

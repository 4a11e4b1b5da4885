#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter (megatron-core >= 0.17 and megatron-bridge >= 0.5 require 3.12);
# used by scripts/install.sh and scripts/device_rehearsal.sh. Exit 1 with a hint when there is none.
set -euo pipefail
find_python() {
  for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv: any installed 3.12.x
  for cand in "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  echo "error: Python 3.12 not found (megatron-core>=0.17 and megatron-bridge>=0.5 require it); install it, e.g. 'pyenv install 3.12'" >&2
  return 1
}

find_python

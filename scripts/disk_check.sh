#!/usr/bin/env bash
# Fail early, in one line, when the file system holding DIR has less than GB gigabytes free.
#   scripts/disk_check.sh DIR GB
# .ci/run calls it before installing (its environments' sizes: docs/performance.md, "CI disk"): a pip install that
# runs out of space midway fails with a bare OSError, far from the cause.
set -euo pipefail
DIR=${1:?usage: scripts/disk_check.sh DIR GB}
NEED_GB=${2:?usage: scripts/disk_check.sh DIR GB}
free_kb=$(df -Pk "$DIR" | awk 'NR == 2 {print $4}')
free_gb=$((free_kb / 1024 / 1024))
if [ "$free_gb" -lt "$NEED_GB" ]; then
  echo "error: $free_gb GB free on the file system of $(cd "$DIR" && pwd); this run's environments need about" \
    "$NEED_GB GB. Free space (old clones' .venv*, .consumers, .pins) or set DSV4_CI_DISK_GB to accept less." >&2
  exit 1
fi
echo "disk: $free_gb GB free on the file system of $(cd "$DIR" && pwd) (needs about $NEED_GB GB)"

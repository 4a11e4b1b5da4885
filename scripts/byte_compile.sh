#!/usr/bin/env bash
# Byte-compile an installed tree once, on every core:   scripts/byte_compile.sh PYTHON DIR
# Where PYTHONDONTWRITEBYTECODE is set (this host sets it), a module left uncompiled is compiled again by every
# interpreter that imports it: each worker, rank and command line of a run (docs/performance.md, "Test harness").
# pip compiles on one core; this uses all of them. A file that does not compile (a package's template or test data)
# is not an error here: Python reports it if it is ever imported.
set -euo pipefail
PYTHON=${1:?usage: scripts/byte_compile.sh PYTHON DIR}
DIR=${2:?usage: scripts/byte_compile.sh PYTHON DIR}
"$PYTHON" -c 'import compileall, sys; compileall.compile_dir(sys.argv[1], quiet=2, workers=0)' "$DIR"

#!/usr/bin/env python
"""Print the consumer support matrix: consumer x version x target x dialect, each cell the status the engine's
own code gives an adapter the implementation exported (fixtures/consumers). Needs scripts/install_consumers.sh.

    .venv/bin/python scripts/consumer_matrix.py            # print the markdown table
    .venv/bin/python scripts/consumer_matrix.py --write    # put it into docs/consumers.md between the markers
    .venv/bin/python scripts/consumer_matrix.py --check    # exit 1 when docs/consumers.md's table differs
    .venv/bin/python scripts/consumer_matrix.py --json F   # also write every probe report to F
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fixtures.consumers import (  # noqa: E402  (the repository root goes on the path first)
    CONSUMER_MATRIX,
    ConsumerEnvMissing,
    probe_all,
    render_matrix,
)
from fixtures.contract.generated import script_parser  # noqa: E402
from fixtures.runner.impl_loader import load_impl, resolve_impl_name  # noqa: E402


def main() -> int:
    parser = script_parser(__doc__, "docs/consumers.md")
    parser.add_argument("--json", type=Path, help="also write the raw probe reports here")
    parser.add_argument("--impl", default=None, help="implementation module (default: impl or $DSV4_IMPL)")
    args = parser.parse_args()

    # stdout carries only the table: the implementation's imports log there
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory(prefix="consumer-matrix-") as tmp:
        api = load_impl(resolve_impl_name(args.impl))
        try:
            all_cells, cases, notes, reports, numeric = probe_all(api, Path(tmp))
        except ConsumerEnvMissing as exc:
            print(f"consumer_matrix: {exc}", file=sys.stderr)
            return 2
    table = render_matrix(all_cells, cases, notes, numeric)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1, sort_keys=True))
    return CONSUMER_MATRIX.apply(table, write=args.write, check=args.check)


if __name__ == "__main__":
    sys.exit(main())

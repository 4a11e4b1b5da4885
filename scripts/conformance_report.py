#!/usr/bin/env python
"""Run an implementation under the suites of the capabilities it declares and print its conformance report
(fixtures/contract/conformance.py).

.venv/bin/python scripts/conformance_report.py                 # implementations.bridge_lora: print the report
.venv/bin/python scripts/conformance_report.py --write         # put it into docs/conformance/bridge_lora.md
.venv/bin/python scripts/conformance_report.py --check         # exit 1 when that document is stale
.venv/bin/python scripts/conformance_report.py --impl implementations.NAME

Exit status 3 when the run itself fails: a known gap that closed, or a test that failed another way
(its output is printed; the xfails file next to the implementation lists the gaps).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.contract.conformance import render_report, report_doc, run_conformance  # noqa: E402  (the root goes first)
from fixtures.contract.generated import script_parser  # noqa: E402


def main() -> int:
    parser = script_parser(__doc__, "the conformance report")
    parser.add_argument("--impl", default="implementations.bridge_lora", help="the implementation module")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers for the run (default 0)")
    args = parser.parse_args()
    print(f"conformance_report: running {args.impl} under its declared capabilities ...", file=sys.stderr)
    run = run_conformance(args.impl, workers=args.workers)
    if run.returncode != 0:
        print(run.output[-6000:], file=sys.stderr)
        print(f"conformance_report: the run failed (pytest exit {run.returncode}); see above", file=sys.stderr)
        return 3
    return report_doc(args.impl).apply(render_report(run), write=args.write, check=args.check)


if __name__ == "__main__":
    sys.exit(main())

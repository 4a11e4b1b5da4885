#!/usr/bin/env python
"""Run implementations under the conformance suites and write their reports (fixtures/contract/conformance.py).

.venv/bin/python scripts/conformance_report.py --write                    # every driver of DRIVERS
.venv/bin/python scripts/conformance_report.py --driver implementations.wrong.pickled   # print one report
.venv/bin/python scripts/conformance_report.py --check --driver implementations.empty    # exit 1 when stale

A driver whose code is not on this machine (Miles: MILES_V1_DIR / MILES_V2_DIR name its checkout) is left out with
the reason. Exit status 3 when a run fails: a known gap that closed, or a test that failed another way (its output
is printed; the xfails file beside the driver lists the gaps).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.contract.conformance import render_report, report_doc, run_conformance  # noqa: E402  (the root goes first)
from fixtures.contract.generated import script_parser  # noqa: E402

#: every driver with a report in docs/conformance/, in the order they are run
DRIVERS = (
    "implementations.reference",
    "implementations.bridge_lora",
    "implementations.miles_v1",
    "implementations.miles_v2",
    "implementations.nemo_automodel",
    "implementations.empty",
    "implementations.wrong.marker_first",
    "implementations.wrong.pickled",
    "implementations.wrong.unprefixed",
    "implementations.wrong.lonely_raise",
    "implementations.wrong.indexer_targets",
)


def unavailable(driver: str) -> str:
    """Why ``driver`` cannot run on this machine ('' when it can): its ``unavailable()``, if it has one."""
    import importlib

    why = getattr(importlib.import_module(driver), "unavailable", None)
    return why() if callable(why) else ""


def main() -> int:
    parser = script_parser(__doc__, "the conformance reports")
    parser.add_argument("--driver", action="append", help="a driver module (repeatable; default: every one)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers for each run (default 2)")
    args = parser.parse_args()
    status = 0
    for driver in args.driver or DRIVERS:
        why = unavailable(driver)
        if why:
            print(f"conformance_report: {driver} left out: {why}", file=sys.stderr)
            continue
        print(f"conformance_report: running {driver} under the conformance suites ...", file=sys.stderr)
        started = time.monotonic()
        run = run_conformance(driver, workers=args.workers)
        print(f"conformance_report: {driver} ran in {time.monotonic() - started:.0f}s", file=sys.stderr)
        if run.returncode != 0:
            print(run.output[-6000:], file=sys.stderr)
            print(
                f"conformance_report: {driver}'s run failed (pytest exit {run.returncode}); see above", file=sys.stderr
            )
            status = max(status, 3)
            continue
        status = max(status, report_doc(driver).apply(render_report(run), write=args.write, check=args.check))
    return status


if __name__ == "__main__":
    sys.exit(main())

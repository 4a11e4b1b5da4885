"""Prove the suite's power: apply each seeded mutation of fixtures/mutations/catalogue/ to a fresh copy of the implementation
and check that the tests named for it fail.

    .venv/bin/python scripts/mutation_check.py [--only NAME[,NAME...]] [--jobs N] [--timeout S] [--keep]
                                               [--earlier-run JUNIT]

Per mutation: copy ``impl/`` under the package name ``impl_mutant`` with the change applied (never to the tree), run
only its tests against the copy in a pytest subprocess (``--impl impl_mutant``, ``-x``, stops at the first failure),
and record KILLED (a test failed: its id is reported) or SURVIVED (all passed). A control run afterwards proves that
each killing test passes on the unmutated copy (one pytest run over those very test nodes), otherwise a "kill" proves
nothing. ERROR: the change no longer applies exactly once (the code moved), the killing test fails unmutated too, the run
did not test the copy, collected nothing, crashed or timed out. Exit status 0 only when every mutation is KILLED.

``--earlier-run JUNIT``: the JUnit XML of a run of the suite on the unmutated implementation, moments before (CI's main
run). A killing test that passed there needs no control run, and the rows start longest first by their tests'
durations there (``fixtures/mutations/earlier_run.py``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from fixtures.mutations import CATALOGUE, Seeded, change_problem  # noqa: E402
from fixtures.mutations.earlier_run import EarlierRun, read_earlier_run  # noqa: E402
from fixtures.runner.impl_copy import MutationError, copy_implementation  # noqa: E402
from fixtures.runner.subproc import pytest_outcomes  # noqa: E402
from fixtures.runner.warm_pytest import pytest_on_copy  # noqa: E402

COPY_NAME = "impl_mutant"  # the control copy has the same name, so the mutation is the only difference
KILLED, SURVIVED, ERROR = "KILLED", "SURVIVED", "ERROR"
#: a change here alters what the copy imports before megatron, which the warm server preloads: such rows run cold
COLD_FILES = frozenset({"compat/__init__.py"})
_FAILED_WORDS = ("FAILED", "ERROR")


@dataclass
class Outcome:
    entry: Seeded
    result: str
    detail: str = ""  # the killing test id, or what went wrong
    seconds: float = 0.0


def _pytest(copy_dir: Path, targets: list[str], k: str | None, *, stop_first: bool, timeout: float, cold: bool = False):
    """Run pytest on ``targets`` against the copy in ``copy_dir``; (exit code, node id -> outcome, output, seconds).
    Forked from the warm server (fixtures/runner/warm_pytest.py) unless ``cold`` or DSV4_COLD_MUTANTS=1."""
    args = ["-m", "cpu", "-n", "0", "-p", "no:randomly", "-rfE"]
    args += ["--impl", COPY_NAME, *(["-x"] if stop_first else []), *(["-k", k] if k else []), *targets]
    start = time.monotonic()
    rc, out = pytest_on_copy(args, copy_dir=copy_dir, copy_name=COPY_NAME, timeout=timeout, cold=cold)
    if rc is None:
        return None, {}, f"timed out after {timeout:g}s:\n{out[-4000:]}", time.monotonic() - start
    return rc, pytest_outcomes(out), out, time.monotonic() - start


def _tested_the_copy(out: str) -> bool:
    return f"dsv4: impl={COPY_NAME} " in out


def run_mutant(entry: Seeded, work: Path, timeout: float) -> Outcome:
    start = time.monotonic()
    where = work / entry.name
    try:
        copy_implementation(where, name=COPY_NAME, mutation=entry.change)
    except MutationError as exc:
        return Outcome(entry, ERROR, str(exc), time.monotonic() - start)
    cold = entry.change.file in COLD_FILES
    rc, outcomes, out, _ = _pytest(where, list(entry.kill), entry.k, stop_first=True, timeout=timeout, cold=cold)
    seconds = time.monotonic() - start
    failed = [node for node, word in outcomes.items() if word in _FAILED_WORDS]
    if rc is None:
        return Outcome(entry, ERROR, f"timed out after {timeout:g}s", seconds)
    if not _tested_the_copy(out):
        return Outcome(entry, ERROR, f"the run did not test {COPY_NAME} (exit {rc}): {_tail(out)}", seconds)
    if rc == 1 and failed:
        return Outcome(entry, KILLED, failed[0], seconds)
    if rc == 0:
        return Outcome(entry, SURVIVED, "every selected test passed", seconds)
    return Outcome(entry, ERROR, f"pytest exit {rc} (5: nothing collected): {_tail(out)}", seconds)


def _tail(out: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in out.strip().splitlines()[-lines:])


def _buckets(functions: list[str], jobs: int) -> list[list[str]]:
    """``functions`` in at most ``jobs`` groups of whole files (a file's module fixtures are built once), the
    largest files first, each to the group with the fewest functions so far."""
    files: dict[str, list[str]] = {}
    for fn in functions:
        files.setdefault(fn.split("::")[0], []).append(fn)
    groups: list[list[str]] = [[] for _ in range(max(1, min(jobs, len(files))))]
    for members in sorted(files.values(), key=len, reverse=True):
        min(groups, key=len).extend(members)
    return groups


def run_control(
    killed: list[Outcome], work: Path, timeout: float, jobs: int = 1, earlier: EarlierRun | None = None
) -> dict[str, str]:
    """Entry name -> why its killing test fails on the unmutated copy too (absent: the kill stands). The control
    runs each killing test once (the very node that killed, parametrization included: the others prove nothing
    about that kill), against a copy without any mutation, split over ``jobs`` concurrent pytest runs; a node that
    passed in ``earlier`` (the unmutated implementation itself) is proven already."""
    proven = earlier.passed if earlier is not None else frozenset()
    functions = list(dict.fromkeys(o.detail for o in killed if o.detail not in proven))
    if proven:
        print(
            f"control: {len({o.detail for o in killed}) - len(functions)} killing tests passed in the earlier run",
            file=sys.stderr,
        )
    if not functions:
        return {}
    copy = copy_implementation(work / "control", name=COPY_NAME)
    groups = _buckets(functions, jobs)
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        runs = list(pool.map(lambda g: _pytest(copy.path, g, None, stop_first=False, timeout=timeout), groups))
    seconds = max(r[3] for r in runs)
    codes = [r[0] for r in runs]
    print(
        f"control: unmutated copy over {len(functions)} killing tests in {len(groups)} run(s): exit {codes} in "
        f"{seconds:.0f}s",
        file=sys.stderr,
    )
    failed, why = [], None
    for rc, outcomes, out, _ in runs:
        if rc == 0 and _tested_the_copy(out):
            continue
        if rc is None or rc != 1 or not _tested_the_copy(out):
            why = why or ("timed out" if rc is None else f"exit {rc}: {_tail(out)}")
            continue
        failed += [node for node, word in outcomes.items() if word in _FAILED_WORDS]
    if why is not None:
        return {o.entry.name: f"control run failed ({why})" for o in killed}
    broken = {}
    for o in killed:
        mine = [node for node in failed if node == o.detail]
        if mine:
            broken[o.entry.name] = f"the unmutated copy fails {mine[0]} too"
    return broken


def _earlier_run(junit: Path | None) -> EarlierRun | None:
    """The record ``--earlier-run`` names; None (every control runs, the catalogue's order) where it is absent or
    unreadable, as after a main run that stopped before writing it."""
    if junit is None:
        return None
    try:
        return read_earlier_run(junit, REPO_ROOT)
    except (OSError, ValueError, ET.ParseError) as exc:
        print(f"mutation_check: {junit} is no JUnit record ({exc}); every control runs", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="mutation name(s), comma-separated; repeatable")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run concurrently (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutation run (default 300)")
    parser.add_argument("--keep", action="store_true", help="keep the copies (their directory is printed)")
    parser.add_argument(
        "--earlier-run",
        type=Path,
        metavar="JUNIT",
        help="JUnit XML of a run on the unmutated implementation: its passed tests need no control; rows start "
        "longest first by its durations",
    )
    args = parser.parse_args(argv)
    wanted = [n for item in args.only for n in item.split(",") if n]
    known = {e.name for e in CATALOGUE}
    if unknown := [n for n in wanted if n not in known]:
        parser.error(f"unknown mutation(s) {unknown}; known: {', '.join(sorted(known))}")
    entries = [e for e in CATALOGUE if not wanted or e.name in wanted]

    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="dsv4-mutants-"))
    outcomes = {e.name: Outcome(e, ERROR, why) for e in entries if (why := change_problem(e)) is not None}
    earlier = _earlier_run(args.earlier_run)
    runnable = [e for e in entries if e.name not in outcomes]
    runnable = earlier.longest_first(runnable) if earlier is not None else runnable
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_mutant, e, work, args.timeout): e for e in runnable}
            for done, future in enumerate(as_completed(futures), 1):
                outcome = future.result()
                outcomes[outcome.entry.name] = outcome
                print(
                    f"[{done}/{len(runnable)}] {outcome.entry.name}: {outcome.result} ({outcome.seconds:.0f}s)",
                    file=sys.stderr,
                )
        killed = [outcomes[e.name] for e in runnable if outcomes[e.name].result == KILLED]
        for name, why in run_control(killed, work, args.timeout * 3, args.jobs, earlier).items():
            outcomes[name] = Outcome(outcomes[name].entry, ERROR, why, outcomes[name].seconds)
    finally:
        if args.keep:
            print(f"copies kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    ordered = [outcomes[e.name] for e in entries]
    print(format_table(ordered, time.monotonic() - start, args.jobs))
    return 0 if all(o.result == KILLED for o in ordered) else 1


def format_table(outcomes: list[Outcome], total: float, jobs: int) -> str:
    rows = [("mutation", "attacks", "result", "s", "killed by / why")]
    rows += [(o.entry.name, o.entry.attacks, o.result, f"{o.seconds:.0f}", o.detail) for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)), r[3].rjust(4), r[4]]) for r in rows]
    counts = {word: sum(o.result == word for o in outcomes) for word in (KILLED, SURVIVED, ERROR)}
    summary = ", ".join(f"{n} {word.lower()}" for word, n in counts.items())
    return "\n".join([*lines, f"{len(outcomes)} mutations: {summary}; total {total:.0f}s with {jobs} job(s)"])


if __name__ == "__main__":
    sys.exit(main())

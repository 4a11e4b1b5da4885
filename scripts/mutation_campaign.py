#!/usr/bin/env python
"""Run the mutation campaign (fixtures/mutations/campaign.py): every mutant cosmic-ray generates in each module,
against the tests that can reach it; then write docs/mutation_campaign.md.

    .venv/bin/python scripts/mutation_campaign.py [--module lora/targets.py ...] [--write]
    .venv/bin/python scripts/mutation_campaign.py --sample 2      # CI: a few random mutants, the machinery alive
    .venv/bin/python scripts/mutation_campaign.py --report        # the report from the sessions, nothing run
    .venv/bin/python scripts/mutation_campaign.py --module M --refresh [--since REV]   # M changed since listed

Per module: copy ``impl/`` as ``impl_mutant`` (never the tree), let cosmic-ray list every mutation of the copy's
module into a session database (out/mutation-campaign/<module>.sqlite, resumable: a rerun continues where it
stopped), and for each one apply it with cosmic-ray, run the module's tests against the copy (forked from the warm
server, ``-x``, no bytecode cache), and record killed / survived / incompetent in the database. A mutant on an
annotation line or by an excluded operator is recorded as skipped, with the reason. Survivors are matched against
the reviewed decisions (campaign_decisions.toml): equivalent or irrelevant, with why; the rest are undecided.
A session remembers the module it listed (``<module>.source.py``); a run refuses a session whose module has changed
since (a pending mutant's occurrence may now name another site), and ``--refresh`` lists it again, carrying over
the results of the mutants the change left alone (``fixtures/mutations/campaign_refresh.py``).
``--sample N`` runs N random mutants of the campaign's modules and fails if one errors or if a survivor is not one
the committed report lists.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from fixtures.mutations.campaign import (  # noqa: E402  (the repository root goes on the path first)
    MODULES,
    CampaignModule,
    annotation_spans,
    changed_lines,
    decisions,
    excluded_operator,
    in_annotation,
)
from fixtures.mutations.campaign_refresh import StaleSession, check_current, refresh, snapshot_of  # noqa: E402
from fixtures.mutations.campaign_report import REPORT, record_run, write_report  # noqa: E402
from fixtures.runner.impl_copy import copy_implementation  # noqa: E402
from fixtures.runner.warm_pytest import pytest_on_copy  # noqa: E402

COPY_NAME = "impl_mutant"
SESSIONS = REPO_ROOT / "out" / "mutation-campaign"


def _session(module: CampaignModule) -> Path:
    return SESSIONS / (module.path.replace("/", "__").removesuffix(".py") + ".sqlite")


def _initialise(module: CampaignModule, module_file: Path, db_path: Path) -> None:
    """List every mutation of ``module_file`` (cosmic-ray's own operators and occurrences) into a new session."""
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB, use_db

    db_path.parent.mkdir(parents=True, exist_ok=True)
    with use_db(str(db_path), WorkDB.Mode.create) as db:
        init([module_file], db, {})
    snapshot_of(db_path).write_text(module_file.read_text())  # what the positions refer to


def _skip_reason(item, annotations) -> str | None:
    mutation = item.mutations[0]
    if in_annotation(mutation.start_pos, annotations):
        return "an annotation (not evaluated under from __future__ import annotations)"
    return excluded_operator(mutation.operator_name)


def _run_one(item, tests: tuple[str, ...], copy_dir: Path, timeout: float):
    """Apply ``item``'s mutation to the copy with cosmic-ray, run ``tests`` against the copy, and say what happened."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import _make_diff, use_mutation
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    mutation = item.mutations[0]
    operator = cosmic_ray.plugins.get_operator(mutation.operator_name)(**(mutation.operator_args or {}))
    with use_mutation(mutation.module_path, operator, mutation.occurrence) as (before, after):
        if after is None:
            return WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
        args = ["-m", "cpu", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider", "-x", "-q"]
        args += ["--impl", COPY_NAME, *tests]
        rc, out = pytest_on_copy(args, copy_dir=copy_dir, copy_name=COPY_NAME, timeout=timeout)
    diff = "\n".join(_make_diff(before, after, mutation.module_path))
    if rc == 0:
        outcome = TestOutcome.SURVIVED
    elif rc == 1 or rc is None:  # a failing test, or a hang the timeout caught: the mutant was noticed
        outcome = TestOutcome.KILLED
    else:  # collection errors, internal errors: the mutant broke the import, which any run notices
        outcome = TestOutcome.INCOMPETENT
    tail = "\n".join(out.strip().splitlines()[-8:]) if out else ""
    if rc is None:  # said, so a kill by a loaded host's clock can be found and run again
        tail = f"timed out after {timeout:g}s\n{tail}"
    return WorkResult(worker_outcome=WorkerOutcome.NORMAL, test_outcome=outcome, output=tail, diff=diff)


class ControlFailed(RuntimeError):
    """The module's tests fail on the unmutated copy: every mutant would look killed."""


def _control(module: CampaignModule, copy_dir: Path, timeout: float) -> None:
    """Run the module's tests on the copy before any mutation: a kill means something only if they pass there."""
    args = ["-m", "cpu", "-n", "0", "-p", "no:randomly", "-p", "no:cacheprovider", "-x", "-q", "--impl", COPY_NAME]
    rc, out = pytest_on_copy([*args, *module.tests], copy_dir=copy_dir, copy_name=COPY_NAME, timeout=timeout)
    if rc != 0:
        tail = "\n".join(out.strip().splitlines()[-12:])
        raise ControlFailed(f"{module.path}: its tests fail on the unmutated copy (exit {rc}):\n{tail}")
    print(f"campaign: {module.path}: control run on the unmutated copy passed", file=sys.stderr)


def run_module(module: CampaignModule, work: Path, timeout: float, limit: int | None = None, rng=None) -> None:
    """Run the pending mutants of ``module`` (``limit`` random ones with ``rng``), recording each in its session."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    copy = copy_implementation(work, name=COPY_NAME)
    module_file = copy.package_dir / module.path
    db_path = _session(module) if limit is None else work / "sample.sqlite"
    if not db_path.exists():
        _initialise(module, module_file, db_path)
    elif limit is None and not check_current(db_path, module_file.read_text(), module.path):
        print(
            f"campaign: {module.path}: its session has no snapshot of the module it listed, so a change since then "
            "cannot be told; --refresh --since REV makes one",
            file=sys.stderr,
        )
    annotations = annotation_spans(module_file.read_text())
    started, ran = time.monotonic(), 0
    _control(module, copy.path, timeout)
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        pending = list(db.pending_work_items)
        if rng is not None:
            pending = rng.sample(pending, min(limit or len(pending), len(pending)))
        for n, item in enumerate(pending, 1):
            why = _skip_reason(item, annotations)
            if why is not None:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=why))
                continue
            ran += 1
            result = _run_one(item, module.tests, copy.path, timeout)
            db.set_result(item.job_id, result)
            before, after = changed_lines(result.diff or "")
            print(
                f"campaign: {module.path} {n}/{len(pending)} {(result.test_outcome or result.worker_outcome).value} "
                f"({time.monotonic() - started:.0f}s): {before} -> {after}",
                file=sys.stderr,
            )
    if limit is None and ran:
        record_run(module.path, time.monotonic() - started, ran)


def _forget_survivors(module: CampaignModule, db_path: Path) -> None:
    """Make the session's undecided survivors pending again (cosmic-ray's database has no call for it)."""
    import sqlite3

    decided = decisions()
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT job_id, diff FROM work_results WHERE test_outcome = 'SURVIVED'").fetchall()
        again = [(job,) for job, diff in rows if (module.path, *changed_lines(diff or "")) not in decided]
        db.executemany("DELETE FROM work_results WHERE job_id = ?", again)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", help="a campaign module (relative to impl/); default: every one")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run (default 300)")
    parser.add_argument("--sample", type=int, help="run N random mutants of the campaign's modules (CI)")
    parser.add_argument(
        "--rerun-survivors", action="store_true", help="run the survivors again (after adding the tests that kill them)"
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="list a changed module again, carrying over the results of the mutants the change left alone",
    )
    parser.add_argument(
        "--since", help="with --refresh, for a session without a snapshot: the git revision it was listed at"
    )
    parser.add_argument("--write", action="store_true", help=f"write {REPORT.relative_to(REPO_ROOT)} afterwards")
    parser.add_argument(
        "--report",
        action="store_true",
        help=f"only write {REPORT.relative_to(REPO_ROOT)} from the sessions; run nothing",
    )
    args = parser.parse_args(argv)
    if args.report:  # other campaigns may be running on the shared copies: touch neither copies nor sessions
        write_report(MODULES, _session)
        print(f"mutation_campaign: wrote {REPORT.relative_to(REPO_ROOT)}", file=sys.stderr)
        return 0
    chosen = [m for m in MODULES if not args.module or m.path in args.module]
    unknown = sorted(set(args.module or ()) - {m.path for m in MODULES})
    if unknown:
        parser.error(f"not campaign modules: {unknown}; known: {[m.path for m in MODULES]}")
    if args.refresh:
        if not args.module:
            parser.error("--refresh needs --module")
        return _refresh(chosen, args.since)
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant of the same size and second must not reuse a stale .pyc
    with tempfile.TemporaryDirectory(prefix="dsv4-campaign-") as tmp:
        if args.sample:
            return _sample(chosen, Path(tmp), args.sample, args.timeout)
        for module in chosen:  # a fixed copy per module, so a session's paths hold when a rerun resumes it
            if args.rerun_survivors and _session(module).exists():
                _forget_survivors(module, _session(module))
            try:
                run_module(module, SESSIONS / "copies" / module.path.replace("/", "__"), args.timeout)
            except StaleSession as stale:
                print(f"mutation_campaign: {stale}", file=sys.stderr)
                return 2
    if args.write:
        write_report(MODULES, _session)
        print(f"mutation_campaign: wrote {REPORT.relative_to(REPO_ROOT)}", file=sys.stderr)
    return 0


def _refresh(modules: list[CampaignModule], since: str | None) -> int:
    """Re-list each module's session for the module as it is now, carrying over what still holds."""
    import subprocess

    for module in modules:
        session = _session(module)
        copy = copy_implementation(SESSIONS / "copies" / module.path.replace("/", "__"), name=COPY_NAME)
        module_file = copy.package_dir / module.path
        if snapshot_of(session).exists():
            old = snapshot_of(session).read_text()
        elif since:
            show = ["git", "-C", str(REPO_ROOT), "show", f"{since}:impl/{module.path}"]
            old = subprocess.run(show, check=True, capture_output=True, text=True).stdout
        else:
            print(f"mutation_campaign: {module.path}: no snapshot; say --since REV", file=sys.stderr)
            return 1
        said = refresh(
            session,
            old,
            module_file.read_text(),
            lambda path, m=module, f=module_file: _initialise(m, f, path),
            alias=lambda text: text.replace(COPY_NAME, "impl"),
        )
        print(f"mutation_campaign: {module.path}: {said}", file=sys.stderr)
    return 0


def _sample(modules: list[CampaignModule], work: Path, n: int, timeout: float) -> int:
    """N random mutants over ``modules``: each must run (killed, survived or incompetent); a survivor must be one the
    committed report lists, so the campaign's record and the code have not drifted apart silently."""
    from cosmic_ray.work_db import WorkDB, use_db

    from fixtures.mutations.campaign_report import campaigned, listed_survivors

    rng = random.Random()
    done = [m for m in modules if m.path in campaigned()]
    if not done:
        print("mutation_campaign: the report holds no campaigned module to sample", file=sys.stderr)
        return 1
    module = rng.choice(done)
    run_module(module, work, timeout, limit=n, rng=rng)
    listed = listed_survivors()
    problems = []
    with use_db(str(work / "sample.sqlite"), WorkDB.Mode.open) as db:
        for _, result in db.completed_work_items:
            if result.worker_outcome in ("exception", "abnormal"):
                problems.append(f"{module.path}: the campaign machinery failed: {(result.output or '')[-300:]}")
            elif result.test_outcome == "survived" and (module.path, *changed_lines(result.diff)) not in listed:
                problems.append(f"{module.path}: a survivor the report does not list: {changed_lines(result.diff)}")
    for line in problems:
        print(f"mutation_campaign: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

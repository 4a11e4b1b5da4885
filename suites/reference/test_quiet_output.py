"""Quiet by default: every ``dsv4-lora`` command, run as a person runs it, prints only its own lines.

What a passing run shows: what it does, one line per step with its time, the table, the verdict, where the report
and the log are. Library output (warnings, INFO logs, import probes with their tracebacks, parameter lists,
progress bars), from the launcher and from every rank, goes to the log file beside the report; ``-v`` shows it on
the terminal as well. A word like "Traceback" or "Warning" on a passing run makes a person think it broke.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fixtures.runner.subproc import pythonpath_first, run

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group("cli")]

MAX_LINES = 40
ALARMING = re.compile(r"Traceback|warning", re.IGNORECASE)
STEP_LINE = re.compile(r"^  \[\s*\d+/(\d+)\] .+ \.\.\. \d+\.\d+s$")
LOG_NAME = "dsv4-lora.log"


@pytest.fixture(scope="module")
def cli(impl):
    """Run the implementation's command line as a person does (``python -m <impl>.cli ...``)."""

    def run_cli(*args: object, timeout: float = 600, env: dict[str, str] | None = None):
        result = run([sys.executable, "-m", f"{impl.name}.cli", *map(str, args)], timeout=timeout, env=env)
        result.terminal = (result.stdout + result.stderr).splitlines()
        return result

    return run_cli


def assert_quiet(result, what: str) -> None:
    shown = "\n".join(result.terminal)
    assert result.returncode == 0, f"{what} exited {result.returncode}:\n{shown[-6000:]}"
    alarming = [line for line in result.terminal if ALARMING.search(line)]
    assert not alarming, f"{what} shows library output on a passing run:\n" + "\n".join(alarming[:20])
    assert len(result.terminal) <= MAX_LINES, f"{what} printed {len(result.terminal)} lines:\n{shown}"


def library_lines(log: Path, terminal: list[str]) -> list[str]:
    """The log's lines that the terminal did not show (what the libraries wrote)."""
    shown = set(terminal)
    return [line for line in log.read_text(errors="replace").splitlines() if line.strip() and line not in shown]


@pytest.fixture(scope="module")
def two_rank_run(cli, tmp_path_factory):
    """``qualify --tp 2``: two ranks, each importing Megatron and transformers."""
    out = tmp_path_factory.mktemp("quiet") / "q"
    return out, cli("qualify", "--tp", "2", "--out", out, timeout=900)


def test_qualify_on_two_ranks_prints_only_its_own_lines(two_rank_run):
    out, result = two_rank_run
    assert_quiet(result, "qualify --tp 2")
    steps = [line for line in result.stdout.splitlines() if STEP_LINE.match(line)]
    declared = {int(STEP_LINE.match(line).group(1)) for line in steps}
    assert len(declared) == 1 and len(steps) == declared.pop(), f"one timed line per step:\n{result.stdout}"
    assert "PASSED" in result.stdout and str(out / "qualify.json") in result.stdout, result.stdout
    assert str(out / LOG_NAME) in result.stdout, f"the verdict does not say where the log is:\n{result.stdout}"


def test_the_log_beside_the_report_holds_what_every_rank_wrote(two_rank_run):
    out, result = two_rank_run
    log = out / LOG_NAME
    assert log.is_file(), f"no log beside the report in {out}: {sorted(p.name for p in out.iterdir())}"
    hidden = library_lines(log, result.terminal)
    assert any(ALARMING.search(line) for line in hidden), f"the log holds no library warning:\n{hidden[:40]}"
    # Megatron prints the parameter count on each tensor-parallel rank: both ranks wrote into the log
    ranks = {m.group(1) for line in hidden if (m := re.search(r"model parallel rank \((\d+),", line))}
    assert ranks == {"0", "1"}, f"the log lacks a rank's own lines (saw tensor-parallel ranks {sorted(ranks)})"


# Loaded by every interpreter the command starts: each message a process receives over a multiprocessing pipe
# (the launcher: a rank's finished step) leaves a progress-bar line open on that process's stderr first, as tqdm
# does mid-bar; the launcher then prints the step line. (In the process that prints, so the order is certain.)
OPEN_LINE_SITECUSTOMIZE = """
import os
from multiprocessing import connection

_recv = connection.Connection.recv


def recv(self):
    message = _recv(self)
    os.write(2, b"\\rcrunching  50%|#####     | 1/2")
    return message


connection.Connection.recv = recv
"""


def test_a_line_a_library_leaves_open_does_not_swallow_a_step_line(cli, tmp_path):
    """Every step line the terminal shows is a line of its own in the log, even right after a library left an
    unfinished progress-bar line there."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OPEN_LINE_SITECUSTOMIZE)
    out = tmp_path / "q"
    result = cli("qualify", "--out", out, timeout=900, env=pythonpath_first(site))
    assert result.returncode == 0, "\n".join(result.terminal[-80:])
    log_lines = (out / LOG_NAME).read_text(errors="replace").split("\n")
    steps = [line for line in result.stdout.splitlines() if STEP_LINE.match(line)]
    assert steps, f"no step lines on the terminal:\n{result.stdout}"
    assert any("crunching  50%" in line for line in log_lines), "the open progress line never reached the log"
    broken = [line for line in steps if line not in log_lines]
    assert not broken, f"step lines that do not stand on a line of their own in the log: {broken}"


@pytest.fixture(scope="module")
def verbose_run(cli, tmp_path_factory):
    """``qualify -v`` on one rank; its base and adapter (one rank: the reload figure the forward check repeats
    is the single-rank one) serve the other commands' cases."""
    out = tmp_path_factory.mktemp("verbose") / "q"
    return out, cli("qualify", "-v", "--out", out, timeout=900)


def test_verbose_shows_the_library_output_too(verbose_run):
    out, result = verbose_run
    assert result.returncode == 0, "\n".join(result.terminal[-80:])
    hidden = library_lines(out / LOG_NAME, [])
    shown = set(result.terminal)
    missing = [line for line in hidden if "\r" not in line and line not in shown]
    assert len(result.terminal) > MAX_LINES and not missing, (
        f"-v leaves {len(missing)} logged lines off the terminal, e.g. {missing[:5]}"
    )
    assert any("Warning" in line for line in result.terminal), "no library warning on the terminal under -v"


@pytest.mark.parametrize("forward", [False, True], ids=["headers", "forward"])
def test_verify_adapter_prints_only_its_own_lines(cli, verbose_run, forward):
    out, _ = verbose_run
    result = cli("verify-adapter", "--base", out / "base", "--adapter", out / "adapter", *["--forward"] * forward)
    assert_quiet(result, f"verify-adapter{' --forward' * forward}")


@pytest.mark.parametrize("source", ["--base", "--manifest"])
def test_coverage_prints_only_its_own_lines(cli, verbose_run, source):
    out, _ = verbose_run
    result = cli("coverage", source, out / "base" if source == "--base" else "flash")
    assert_quiet(result, f"coverage {source}")


def test_export_for_a_consumer_prints_only_its_own_lines(cli, verbose_run, tmp_path):
    out, _ = verbose_run
    dest = tmp_path / "for-peft"
    result = cli("export", "--adapter", out / "adapter", "--out", dest, "--consumer", "peft")
    assert_quiet(result, "export --consumer peft")
    assert not (dest / LOG_NAME).exists(), "the export's log landed inside the published adapter"


def test_bad_input_is_a_problem_line_naming_the_file_and_no_traceback(cli, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    log = tmp_path / "coverage.log"
    result = cli("coverage", "--base", base, "--log", log)
    assert result.returncode == 1, result.terminal
    assert not any("Traceback" in line for line in result.terminal), "\n".join(result.terminal)
    assert any(("problem:" in line or "error:" in line) and str(base) in line for line in result.terminal), (
        "no problem line naming the file:\n" + "\n".join(result.terminal)
    )
    assert log.exists(), "the log was not written"

"""What a ``dsv4-lora`` command shows a person, and where everything else goes: the one console/log policy.

The terminal gets only the command's own lines: steps with their times, the table, the verdict, where the report and
log are, and problem lines. Everything libraries, C++ code and rank processes write goes to the log file
(``OUT/dsv4-lora.log``); ``-v/--verbose`` shows it on the terminal too. How: :class:`Console`."""

from __future__ import annotations

import io
import os
import select
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from dsv4_launcher import progress

__all__ = [
    "LOG_NAME",
    "Console",
    "Progress",
    "declare_steps",
    "default_log_path",
    "problem",
    "say",
    "show",
    "step",
]

LOG_NAME = "dsv4-lora.log"
EXIT_FAILED = 1


def default_log_path(command: str, out: str | os.PathLike[str] | None) -> Path:
    """``OUT/dsv4-lora.log`` for a command that writes a report; else one file per command in the temp dir (a
    command that reads an adapter or a base must not add a file to it)."""
    if out is not None:
        return Path(out) / LOG_NAME
    return Path(tempfile.gettempdir()) / f"dsv4-lora-{os.getuid()}" / f"{command}.log"


class _Tee(io.TextIOBase):
    """A text stream that writes to several (the terminal and the log)."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:
        return self.streams[0].isatty()


class _OwnLines(io.RawIOBase):
    """The log as the command's own lines reach it: each starts on a line of its own.

    A library may have left a line open in the log (a progress bar redraws itself with ``\r`` and ends its line
    only when done); a line of ours appended to it would read as the library's."""

    def __init__(self, fd: int):
        self.fd = fd
        self.at_line_start = True  # our own last write ended a line

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        if self.at_line_start and data:
            size = os.fstat(self.fd).st_size
            if size and os.pread(self.fd, 1, size - 1) != b"\n":
                os.write(self.fd, b"\n")
        written = os.write(self.fd, data)
        self.at_line_start = data[:written].endswith(b"\n")
        return written

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


class _Copier(threading.Thread):
    """Verbose mode: copy what lands on descriptors 1 and 2 to the terminal as it comes, and to the log a whole
    line at a time (two streams, or a stream and the command's own lines, never share a line there)."""

    def __init__(self, pairs: list[tuple[int, int]], log_fd: int):
        super().__init__(name="dsv4-lora-log-copier", daemon=True)
        self.pairs = dict(pairs)  # pipe read end -> terminal descriptor
        self.open_lines = {fd: b"" for fd in self.pairs}  # what a stream wrote after its last newline
        self.log_fd = log_fd
        self.stopping = False

    def run(self) -> None:
        while self.pairs:
            ready, _, _ = select.select(list(self.pairs), [], [], 0.1)
            if not ready and self.stopping:
                break
            for fd in ready:
                self._copy(fd, os.read(fd, 65536))
        for rest in self.open_lines.values():
            if rest:
                _write_quietly(self.log_fd, rest + b"\n")

    def _copy(self, fd: int, data: bytes) -> None:
        if not data:  # every writer closed it
            os.close(fd)
            del self.pairs[fd]
            return
        _write_quietly(self.pairs[fd], data)
        lines, _, rest = (self.open_lines[fd] + data).rpartition(b"\n")
        self.open_lines[fd] = rest
        if lines:
            _write_quietly(self.log_fd, lines + b"\n")


def _write_quietly(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:  # the terminal went away: the command goes on
        pass


class Console:
    """The terminal and the log of one command run (a context manager).

    The terminal gets the command's own lines: what it does, one line per step with its time, the table, the
    verdict, where the report and the log are, and problem lines. Everything the libraries write (warnings, INFO
    logs, import probes with their tracebacks, progress bars, parameter lists, C++ messages), in this process and in
    every rank it starts, goes to the log file (``OUT/dsv4-lora.log`` beside the report); ``verbose`` shows it on
    the terminal too.

    How: it points file descriptors 1 and 2 at the log (verbose: at pipes that a thread copies to the log and to the
    terminal), so C++ code, the rank processes and any other child, which all inherit the descriptors, land there as
    well. ``sys.stdout`` becomes a stream on a duplicate of the terminal (copied into the log), so a command's own
    ``print`` still reaches the person; ``sys.stderr`` stays on descriptor 2: Python warnings and logging go to the
    log. Problem lines go through :meth:`problem`. A rank sends its progress lines to the launcher over its pipe
    (``dsv4_launcher.progress``), which shows them here: the rank's own descriptors point at the log.
    """

    def __init__(self, log_path: str | os.PathLike[str], *, verbose: bool = False):
        self.log_path = Path(log_path)
        self.verbose = verbose
        self.progress: Progress | None = None
        self._saved: tuple[int, int] | None = None
        self._streams: tuple[Any, Any] = (sys.stdout, sys.stderr)
        self._copier: _Copier | None = None

    def __enter__(self) -> Console:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.terminal = open(os.dup(self._saved[0]), "w", buffering=1, errors="replace")
        self.terminal_err = open(os.dup(self._saved[1]), "w", buffering=1, errors="replace")
        self.log = io.TextIOWrapper(io.BufferedWriter(_OwnLines(os.dup(log_fd))), line_buffering=True, errors="replace")
        if self.verbose:
            pairs = []
            for fd, terminal in ((1, self._saved[0]), (2, self._saved[1])):
                read_end, write_end = os.pipe()
                os.dup2(write_end, fd)
                os.close(write_end)
                pairs.append((read_end, terminal))
            self._copier = _Copier(pairs, os.dup(log_fd))  # its own descriptor: log_fd is closed below
            self._copier.start()
        else:
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stdout = _Tee(self.terminal, self.log)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = self._streams
        assert self._saved is not None
        os.dup2(self._saved[0], 1)  # children that inherited the log keep it; this process writes to the terminal
        os.dup2(self._saved[1], 2)
        if self._copier is not None:  # children may still hold the pipes: drain what is there, then stop
            self._copier.stopping = True
            self._copier.join(timeout=2.0)
            if not self._copier.is_alive():
                os.close(self._copier.log_fd)
        for stream in (self.terminal, self.terminal_err, self.log):
            stream.close()
        for fd in self._saved:
            os.close(fd)

    def say(self, line: str) -> None:
        """One of the command's own lines: on the terminal and in the log."""
        sys.stdout.write(line + "\n")

    def problem(self, line: str) -> None:
        """A problem line: on the terminal's stderr and in the log."""
        self.terminal_err.write(line + "\n")
        self.log.write(line + "\n")

    def run(self, command: Callable[[Any], int], args: Any) -> int:
        """``command(args)``; what it raises becomes a problem line (the traceback goes to the log) and exit 1."""
        from impl.errors import Dsv4Error

        try:
            return command(args)
        except Dsv4Error as exc:
            traceback.print_exc()
            self.problem(f"error: {exc}")
        except Exception as exc:  # a bug, not bad input: the person gets a line, the log the traceback
            traceback.print_exc()
            self.problem(f"error: {type(exc).__name__}: {exc} (traceback in {self.log_path})")
        return EXIT_FAILED


class Progress:
    """Numbered step lines, each with its time: ``[k/n] what ... 0.4s``."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def line(self, what: str, seconds: float) -> str:
        self.done += 1
        width = len(str(self.total))
        return f"  [{self.done:>{width}}/{self.total}] {what} ... {seconds:.1f}s"


_ACTIVE: list[Console] = []  # the console of the command running in this process, if any


def declare_steps(total: int) -> None:
    """The running command will report ``total`` steps: number their lines ``[k/total]``."""
    if _ACTIVE:
        _ACTIVE[-1].progress = Progress(total)


def problem(line: str) -> None:
    """A problem line for the person (the terminal's stderr, and the log)."""
    if _ACTIVE:
        _ACTIVE[-1].problem(line)
    else:
        print(line, file=sys.stderr, flush=True)


def say(line: str) -> None:
    """Print one of the command's own lines on the person's terminal, from the command or from a rank."""
    send = progress.forwarding()
    if send is not None:
        send(("say", line))
    elif _ACTIVE:
        _ACTIVE[-1].say(line)
    else:
        print(line, flush=True)


def step(what: str, seconds: float) -> None:
    """Report a finished step and its time; numbered when the running command declared its steps."""
    send = progress.forwarding()
    if send is not None:
        send(("step", (what, seconds)))
        return
    steps = _ACTIVE[-1].progress if _ACTIVE else None
    say(steps.line(what, seconds) if steps else f"  {what} ... {seconds:.1f}s")


def show(message: tuple[str, Any]) -> None:
    """Show a progress message a rank sent the launcher (``dsv4_launcher.progress``) as this command's own line."""
    kind, value = message
    if kind == "step":
        step(*value)
    else:
        say(value)


progress.display_with(show)

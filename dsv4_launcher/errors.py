"""The launcher's errors, all of them (the rule of every top-level package: its error classes live in its
``errors.py``). The command line reports them as it reports its own typed errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["BackendMismatch", "LaunchError", "LauncherError", "RanksDisagree"]


class LauncherError(RuntimeError):
    """Base class of the launcher's errors."""


class LaunchError(LauncherError):
    """One or more ranks failed or did not finish; the message is the per-rank report (``results``: every rank's
    result, ``root_cause``: the first failure's, as the launcher found them)."""

    def __init__(self, report: str, *, results: Sequence[Any], root_cause: Any = None):
        super().__init__(report)
        self.results = list(results)
        self.root_cause = root_cause


class RanksDisagree(LauncherError):
    """The ranks of a launched world are not about to run the same thing (function, case or caller's label)."""


class BackendMismatch(LauncherError):
    """The call asks for one backend (NCCL for a GPU run) but this rank's default process group has another."""

"""A rank's progress lines travel to the launcher over the rank's pipe, and the launcher shows them.

In a rank, :func:`forwarding` is the pipe's send while a launched function runs (``spawn`` sets it); whoever
prints progress (the command line's ``impl.cli.output``) sends ``("say", line)`` / ``("step", (what, seconds))``
there instead of printing. In the launcher, :func:`show` hands each message to the display registered with
:func:`display_with` (the command line's console), or prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["display_with", "forward_to", "forwarding", "show"]

Message = tuple[str, Any]
_SEND: list[Callable[[Message], None]] = []
_DISPLAY: list[Callable[[Message], None]] = []


def forward_to(send: Callable[[Message], None] | None) -> None:
    """In a rank process: send progress messages to the launcher (``None``: stop)."""
    _SEND.clear()
    if send is not None:
        _SEND.append(send)


def forwarding() -> Callable[[Message], None] | None:
    """Where this rank's progress messages go, or None outside a launched function."""
    return _SEND[0] if _SEND else None


def display_with(display: Callable[[Message], None]) -> None:
    """In the launcher: show the ranks' messages with ``display``."""
    _DISPLAY[:] = [display]


def show(message: Message) -> None:
    """The launcher's side of :func:`forward_to`: show a message a rank sent."""
    if _DISPLAY:
        _DISPLAY[0](message)
        return
    kind, value = message
    print(f"  {value[0]} ... {value[1]:.1f}s" if kind == "step" else value, flush=True)

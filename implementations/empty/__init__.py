"""An implementation that declares every capability and implements nothing: under the conformance suites it must
pass no test (docs/conformance/empty.md)."""

from __future__ import annotations

from dsv4_conformance.driver import Driver


class EmptyDriver(Driver):
    name = "empty"
    capabilities = frozenset({"detection", "targets", "conversion", "lora", "export", "faults", "training_loop"})


DRIVER = EmptyDriver(provenance="nothing: every method is the contract's own")

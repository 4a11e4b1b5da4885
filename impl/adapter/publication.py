"""Publishing the adapter to a rollout engine every step, in memory: an RL trainer's weight sync.

Each version is validated exactly as the file export is, then takes ``previous + 1``; its tensors are owned copies
(the next optimizer step changes the parameters in place) with SGLang's per-tensor ``expected_checksums``. A
refused state publishes nothing: the version and the current publication stay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from impl.adapter.build import AdapterState, NonFiniteAdapterError, all_finite, publish_in_memory, raw_bytes
from impl.adapter.exchange import StatusExchange
from impl.errors import PublicationError

__all__ = [
    "AdapterPublisher",
    "Publication",
    "tensor_checksum",
]


@dataclass(frozen=True)
class Publication:
    """One published version: PEFT-named tensors (owned copies), ``adapter_config.json`` and the checksums in the
    form SGLang's ``expected_checksums`` takes."""

    version: int
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    expected_checksums: dict[str, str]


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's contiguous bytes (what an engine computes on the tensor it received)."""
    return hashlib.sha256(raw_bytes(t).data).hexdigest()


class AdapterPublisher:
    """Versioned in-memory publications of one adapter; ``options``: :func:`publish_in_memory`'s (dialect,
    consumer, base fingerprint, ...), the same for every version.

    Miles' colocated path hands the engine the whole adapter under one fixed name and bumps a ``weight_version``;
    SGLang's ``load_lora_adapter_from_tensors`` can check ``expected_checksums`` (name -> sha256 hex of the
    tensor's contiguous bytes). This is that sequence for one trainer."""

    def __init__(self, **options: Any):
        self._options = options
        self._current: Publication | None = None
        self._version = 0

    @property
    def version(self) -> int:
        """The current version (0 before the first publication); the same on every rank of a collective publisher."""
        return self._version

    @property
    def current(self) -> Publication | None:
        return self._current

    def publish(self, state: AdapterState | Mapping[str, AdapterState]) -> Publication:
        """Validate and publish ``state`` as the next version; raises the export's typed error (nothing changes)."""
        self._current = self._prepare(state)
        self._version = self._current.version
        return self._current

    def publish_model(
        self, model_chunks: Sequence[Any], handle: Any, *, writer_rank: int = 0, timeout_s: float = 60.0
    ) -> Publication | None:
        """Collective: publish the adapter of ``model_chunks`` as the next version; returns the publication on
        ``writer_rank``, None elsewhere. Call on every rank; every rank's :attr:`version` advances.

        Each rank first checks its own shards (a NaN is named by the rank that holds it), the ranks agree, the
        adapter is gathered to the writer, validated and published there, and the ranks agree again; a failure
        anywhere raises the same :class:`PublicationError` on every rank within the timeout, and every rank keeps
        the previous version."""
        from impl.adapter.gather import adapter_parameters, gather_adapter_state

        ex = StatusExchange(timeout_s, topic="dsv4_publication")
        chunks = list(model_chunks)

        def own_shards() -> None:
            for name, param, _ in adapter_parameters(chunks):
                if not all_finite(param.detach()):
                    raise NonFiniteAdapterError(f"{name} holds NaN or Inf on this rank; nothing published")

        _agreed(ex, "check", own_shards, self._version)
        writer = ex.rank == writer_rank

        def gather_and_publish() -> Publication | None:
            state = gather_adapter_state(chunks, handle, writer_rank=writer_rank)
            return self._prepare(state) if writer else None

        candidate = _agreed(ex, "publish", gather_and_publish, self._version)
        self._version += 1
        if writer:
            self._current = candidate
        return candidate

    def _prepare(self, state: AdapterState) -> Publication:
        tensors, config = publish_in_memory(state, **self._options)
        owned = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        return Publication(self._version + 1, owned, config, {n: tensor_checksum(t) for n, t in owned.items()})


def _agreed(ex: StatusExchange, phase: str, run: Callable[[], Any], version: int) -> Any:
    """``run()`` on this rank, then the ranks agree; the same :class:`PublicationError` everywhere on a failure."""
    return ex.run(
        phase,
        run,
        lambda failures: PublicationError(
            f"publication of version {version + 1} failed in phase {phase}: {failures}. "
            f"Nothing was published; version {version} stays current."
        ),
    )

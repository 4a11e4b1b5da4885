"""Publishing the adapter to a rollout engine every step, in memory (an RL job's trainer -> rollout weight sync).

Miles' colocated path hands the engine the whole adapter's tensors under one fixed name and bumps a
``weight_version``; SGLang's ``load_lora_adapter_from_tensors`` can check per-tensor sha256 ``expected_checksums``
(name -> sha256 hex of the tensor's contiguous bytes). :class:`AdapterPublisher` is that sequence for one trainer:
each :meth:`~AdapterPublisher.publish` validates exactly as the file export does (:func:`publish_in_memory`), and
only then takes version ``previous + 1``; the published tensors are copies that share no storage with the live
parameters (the next optimizer step changes the parameters in place: an alias would change what the engine holds),
and carry their checksums. A refused state publishes nothing: the version and the current publication stay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from impl.adapter.build import AdapterState, publish_in_memory, raw_bytes


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
    consumer, base fingerprint, ...), the same for every version."""

    def __init__(self, **options: Any):
        self._options = options
        self._current: Publication | None = None

    @property
    def version(self) -> int:
        """The current version (0 before the first publication)."""
        return 0 if self._current is None else self._current.version

    @property
    def current(self) -> Publication | None:
        return self._current

    def publish(self, state: AdapterState | Mapping[str, AdapterState]) -> Publication:
        """Validate and publish ``state`` as the next version; raises the export's typed error (nothing changes)."""
        tensors, config = publish_in_memory(state, **self._options)
        owned = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        sums = {name: tensor_checksum(t) for name, t in owned.items()}
        self._current = Publication(self.version + 1, owned, config, sums)
        return self._current


__all__ = ["AdapterPublisher", "Publication", "tensor_checksum"]

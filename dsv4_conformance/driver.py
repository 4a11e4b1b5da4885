"""The driver contract: what the conformance suites ask of an implementation, and nothing more.

An implementation is put under the suites by one file that subclasses :class:`Driver` and overrides the methods its
capabilities need (``docs/driver.md`` is generated from this module). The suites call nothing else of it: not its
classes, not its message texts, not its file names. A method left as it is here raises :class:`DriverMissing`,
which no test can mistake for an expected error, so nothing unimplemented passes.

The seams are the ones every DeepSeek-V4 LoRA implementation has, named in the checkpoint's own vocabulary
(``layers.{i}.attn.wq_b``): a base directory in DeepSeek's published layout goes in, logits, losses and an adapter
directory come out, and the judge (``dsv4_conformance/judge/``) decides from those alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

#: The five main-attention projections, as the checkpoint names them: the LoRA targets every V4 implementation has.
MAIN_ATTENTION: tuple[str, ...] = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
#: The naming dialects of an adapter's modules, by who reads them: ``transformers`` (PEFT on transformers,
#: ``model.layers.N.self_attn.q_a_proj``), ``official`` (vLLM, the checkpoint's ``layers.N.attn.wq_a``), ``sglang``
#: (``model.layers.N.self_attn.wq_a``).
DIALECTS: tuple[str, ...] = ("transformers", "official", "sglang")


class DriverMissing(BaseException):
    """The driver does not implement a method a test needs.

    A ``BaseException``, not an ``Exception``: a test that expects the implementation to raise (``pytest.raises``,
    a rank expected to fail) must never be satisfied by a method that is simply not there.
    """


@dataclass(frozen=True)
class Layout:
    """How the model is split over the ranks of the current process group, and the dtype of its weights."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    dtype: str = "float32"
    #: every collective of the model's process groups gives up after this long (a peer that died must not hang it)
    collective_timeout_s: float = 60.0

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("ep", self.ep), ("pp", self.pp)) if v > 1]
        return "x".join(parts or ["dp"]) + ("" if self.dtype == "float32" else f"-{self.dtype}")


@dataclass(frozen=True)
class LoraSpec:
    """The adapter to build: target leaf names in the checkpoint's vocabulary, rank and alpha (scale alpha/rank)."""

    targets: tuple[str, ...] = MAIN_ATTENTION
    rank: int = 4
    alpha: float = 8.0


@dataclass(frozen=True)
class LoadReport:
    """What loading the base did: checkpoint tensors placed, and every offender by its checkpoint name.

    ``missing``: parameters of the model no checkpoint tensor filled (named by the checkpoint name that should have).
    ``unexpected``: checkpoint tensors that went nowhere. A strict loader reports every one, not the first.
    """

    loaded: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return self.loaded > 0 and not self.missing and not self.unexpected


@dataclass
class Driver:
    """One implementation, as the conformance suites see it. Override what your capabilities need.

    Every method runs on every rank of the current ``torch.distributed`` process group (gloo on a CPU host; the
    suites create it) unless it says otherwise. ``model`` is whatever :meth:`build` returned: the suites only hand
    it back.
    """

    #: the implementation's name in reports
    name: ClassVar[str] = "unnamed"
    #: the suite folders (``suites/<capability>/``) this driver declares; the others are skipped with the reason
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: the file an export writes last to certify the adapter beside it (None: the implementation writes none)
    success_marker: ClassVar[str | None] = None
    #: the naming dialects (``DIALECTS``) :meth:`export` writes; only these are asked of it
    dialects: ClassVar[frozenset[str]] = frozenset({"transformers"})
    #: where the implementation's code came from (a version, a commit): printed in its report
    provenance: str = field(default="")

    # -- detection -------------------------------------------------------------------------------------------------

    def recognises(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` (a ``config.json``, parsed) is DeepSeek-V4, the model this implementation builds.

        Judged: exactly the configs whose ``architectures[0]`` is ``DeepseekV4ForCausalLM``; never V3, V3.2, V4.1 or
        a look-alike."""
        raise DriverMissing("recognises")

    # -- targets ---------------------------------------------------------------------------------------------------

    def qualify(self, targets: Sequence[str], config: Mapping[str, Any]) -> list[str]:
        """The modules LoRA would wrap for ``targets`` on a model of ``config``, in the checkpoint's names
        (``layers.0.attn.wq_b``, no ``.weight``). A target it cannot place raises, naming it.

        Judged: each target wraps exactly its projection in every layer's main attention, never the DSA indexer's
        or a compressor's module of the same leaf name."""
        raise DriverMissing("qualify")

    # -- the model -------------------------------------------------------------------------------------------------

    def build(self, base: Path, layout: Layout, lora: LoraSpec | None) -> Any:
        """This rank's share of the model for the base directory ``base`` (``config.json`` + safetensors in
        DeepSeek's published naming) at ``layout``, with LoRA ``lora`` (None: no adapter), ready to train.

        May be called again on the same rank: the new model replaces the old one. A base it cannot load
        raises, naming the offending tensors."""
        raise DriverMissing("build")

    def load_report(self, model: Any) -> LoadReport:
        """What loading the base into ``model`` did (see :class:`LoadReport`), the same on every rank."""
        raise DriverMissing("load_report")

    def logits(self, model: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Float logits ``[batch, seq, vocab]`` for ``input_ids`` (``[batch, seq]`` int64, the same on every rank),
        evaluation mode, adapter applied. Global rank 0 must return them; other ranks may return None."""
        raise DriverMissing("logits")

    def train_step(self, model: Any, input_ids: torch.Tensor, labels: torch.Tensor, lr: float) -> float:
        """One step of plain SGD (``p -= lr * grad``) on the adapter alone, for the loss: the mean over every
        position of the cross entropy of ``logits[b, t]`` against ``labels[b, t]``. Returns that loss (before the
        step) on every rank. The gradient must be the implementation's own."""
        raise DriverMissing("train_step")

    def adapter_parameters(self, model: Any) -> dict[str, torch.Tensor]:
        """This rank's adapter tensors (the live parameters, not copies), by any names the implementation likes."""
        raise DriverMissing("adapter_parameters")

    # -- export ----------------------------------------------------------------------------------------------------

    def export(self, model: Any, out_dir: Path, timeout_s: float, dialect: str = "transformers") -> None:
        """Write the adapter alone to ``out_dir`` in PEFT's format, collectively: call on every rank.

        ``dialect`` is passed only when it is not ``transformers``, and only one of its ``dialects``: a driver that
        writes transformers' names alone may leave the parameter out.

        Judged by its artifacts: ``adapter_model.safetensors`` + ``adapter_config.json`` that PEFT loads onto
        transformers' ``DeepseekV4ForCausalLM`` of the base and reproduces :meth:`logits` (another dialect: every
        module in that dialect's names, read back as transformers'); the success marker (if declared) only beside
        a valid adapter. On any failure on any rank, every rank raises within ``timeout_s``, naming the rank or the
        cause, and ``out_dir`` is left as it was (an earlier export intact)."""
        raise DriverMissing("export")

    # -- optional: the training loop -------------------------------------------------------------------------------

    def import_adapter(self, model: Any, adapter_dir: Path) -> None:
        """Load a PEFT adapter directory (one this implementation exported) into ``model``'s adapter, collectively.

        Judged: a fresh model that imports an export computes the exported model's logits, and exports it again
        bit for bit."""
        raise DriverMissing("import_adapter")

    # -- what the harness asks of a driver --------------------------------------------------------------------------

    def warm(self) -> None:
        """Not part of the contract, for speed only: import what :meth:`build` needs, before a rank's clock starts."""

    @classmethod
    def implements(cls, method: str) -> bool:
        """Whether this driver overrides ``method`` of the contract."""
        return getattr(cls, method) is not getattr(Driver, method)


#: the contract's methods, in the order the page lists them
METHODS: tuple[str, ...] = (
    "recognises",
    "qualify",
    "build",
    "load_report",
    "logits",
    "train_step",
    "adapter_parameters",
    "export",
    "import_adapter",
)
#: the methods no capability requires
OPTIONAL: frozenset[str] = frozenset({"import_adapter"})


def load_driver(module: str) -> Driver:
    """The driver a module names: its ``DRIVER`` (an instance of a :class:`Driver` subclass)."""
    import importlib

    found = getattr(importlib.import_module(module), "DRIVER", None)
    if not isinstance(found, Driver):
        raise TypeError(f"{module}.DRIVER must be an instance of dsv4_conformance.driver.Driver, got {found!r}")
    return found


__all__ = [
    "DIALECTS",
    "MAIN_ATTENTION",
    "METHODS",
    "OPTIONAL",
    "Driver",
    "DriverMissing",
    "Layout",
    "LoadReport",
    "LoraSpec",
    "load_driver",
]

"""Exporting for a consumer: which engines a ``--consumer`` name stands for, and the fail-closed verdict an export
for it passes (:func:`consumer_verdict`, :func:`require_applied`, used by the exporter and ``verify-adapter
--consumer``). The engines' rules themselves are the conformance judge's table
(:mod:`dsv4_conformance.judge.consumers`, checked against each engine release's own code), re-exported here: the
exporter fails closed by the table the suites and ``verify-adapter`` judge with. No megatron imports: exporter
ranks read it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The engines' rules are the judge's (facts about the engines, each checked against their own code): the exporter
# fails closed by the same table verify-adapter and the suites judge with.
from dsv4_conformance.judge.consumers import (
    CONSUMER_RULES,
    MTP,
    OFF_TARGET_HAZARD,  # noqa: F401  (re-exported: impl.adapter.validation names the hazard by it)
    OFF_TARGET_PEFT,
    TARGET_LEAVES,
    WHOLE_ADAPTER,
    ConsumerRule,
    ConsumerStatus,
    consumer_rule,
    tested_versions,
    unapplied_targets,
)
from impl.errors import ConsumerSupportError

__all__ = [
    "CONSUMER_RULES",
    "ConsumerRule",
    "ConsumerStatus",
    "consumer_rule",
    "consumer_verdict",
    "split_consumer",
    "tested_versions",
    "unapplied_targets",
]


def split_consumer(spec: str, version: str | None = None) -> tuple[str, str | None]:
    """``vllm==0.34.0`` -> (``vllm``, ``0.34.0``); ``vllm`` -> (``vllm``, ``version``). A release named both ways
    must be the same one (:class:`ConsumerSupportError` else)."""
    name, pinned, release = spec.partition("==")
    if not pinned:
        return name.strip(), version
    if version is not None and version != release.strip():
        raise ConsumerSupportError(
            f"consumer {spec!r} and consumer version {version!r} name different releases; name one"
        )
    return name.strip(), release.strip()


# ------------------------------------------------------------------------------------- exporting for a consumer


@dataclass(frozen=True)
class ConsumerChoice:
    """What ``--consumer NAME`` (``consumer=NAME``) stands for: the engines of :data:`CONSUMER_RULES` whose rules
    must all hold, and the dialect to write when the caller names none."""

    name: str
    engines: tuple[str, ...]
    dialect: str
    note: str


#: The names a user gives. Every engine of the table is also a name of its own (e.g. ``vllm/cpu``).
CONSUMER_CHOICES: dict[str, ConsumerChoice] = {
    # Only the platforms whose model implements SupportsLoRA: vLLM's CPU model refuses LoRA outright, so
    # including it would refuse every export; ask for vllm/cpu by name to see that.
    "vllm": ConsumerChoice("vllm", ("vllm/nvidia", "vllm/xpu"), "official", "vLLM's LoRA platforms (nvidia, xpu)"),
    "sglang": ConsumerChoice("sglang", ("sglang",), "sglang", "SGLang"),
    "peft": ConsumerChoice("peft", ("peft",), "transformers", "PEFT on transformers' DeepseekV4ForCausalLM"),
}


def consumer_choice(name: str) -> ConsumerChoice:
    """The choice for ``name`` (a family above or one engine of the table, with or without ``==RELEASE``);
    :class:`ConsumerSupportError` else."""
    name, _ = split_consumer(name)
    if name in CONSUMER_CHOICES:
        return CONSUMER_CHOICES[name]
    engines = {r.consumer for r in CONSUMER_RULES}
    if name in engines:  # one platform variant of a family, e.g. vllm/cpu
        return ConsumerChoice(name, (name,), CONSUMER_CHOICES[name.split("/")[0]].dialect, name)
    known = sorted({*CONSUMER_CHOICES, *engines})
    raise ConsumerSupportError(f"consumer {name!r}: impl holds no rules for it; known consumers: {known}")


@dataclass(frozen=True)
class ConsumerVerdict:
    """One adapter (its dialect and targets) judged by one consumer version's rules."""

    consumer: str
    version: str
    dialect: str
    not_applied: tuple[ConsumerRule, ...]  # every rule that does not apply its target (the whole adapter first)
    unknown: tuple[str, ...]  # "engine: target" with no rule: nobody checked, so nothing is vouched for
    tested: tuple[str, ...] = ()  # every release impl holds rules for (a lane ran), oldest first
    defaulted: bool = False  # the caller named no release: ``version`` is the newest tested one

    def release_note(self) -> str:
        """Which release judged, and how it was chosen (what the command line prints)."""
        how = "the newest tested release" if self.defaulted else "the release named"
        name = self.consumer.partition("==")[0]
        return f"{name} {self.version} ({how}; tested: {', '.join(self.tested)}; name one with {name}==RELEASE)"

    @property
    def ok(self) -> bool:
        return not self.not_applied and not self.unknown

    def problems(self) -> list[str]:
        """One line per target the consumer would not apply: engine, version, dialect, target, status, why."""
        lines = [
            f"{r.consumer} {r.version} ({r.dialect} dialect): {r.target}: {r.status}"
            + (f" -> {r.routed_to}" if r.routed_to else "")
            + f": {r.why}"
            for r in self.not_applied
        ]
        lines += [
            f"{u} ({self.dialect} dialect, {self.version}): no rule in impl.CONSUMER_RULES, so nothing vouches that "
            "it is applied"
            for u in self.unknown
        ]
        return lines

    def record(self) -> dict:
        """What an opt-in export writes into the adapter's metadata (``dsv4_consumer``)."""
        unapplied = [
            {"engine": r.consumer, "target": r.target, "status": str(r.status), "routed_to": r.routed_to, "why": r.why}
            for r in self.not_applied
        ]
        return {
            "consumer": self.consumer,
            "version": self.version,
            "dialect": self.dialect,
            "unapplied": unapplied,
            "unknown": list(self.unknown),
        }


def consumer_verdict(
    consumer: str, dialect: str, targets: Iterable[str], version: str | None = None
) -> ConsumerVerdict:
    """Judge an adapter of ``dialect`` holding ``targets`` (:data:`TARGET_LEAVES` entries or :data:`MTP`) by
    ``consumer`` (:func:`consumer_choice`; ``vllm==0.34.0`` names the release) at ``version`` (default: the newest
    release a lane tested). A release no lane ran raises :class:`ConsumerSupportError` listing the tested ones."""
    consumer, version = split_consumer(consumer, version)
    choice = consumer_choice(consumer)
    versions = tested_versions(choice.engines)
    defaulted = version is None and bool(versions)
    if defaulted:
        version = versions[-1]
    if version not in versions:
        raise ConsumerSupportError(
            f"consumer {consumer!r} version {version!r}: no lane tested that release; impl holds rules for "
            f"versions {versions} only (an unchecked version is never vouched for; name one with "
            f"{consumer}==VERSION, consumer_version or --consumer-version)"
        )
    wanted = (WHOLE_ADAPTER, *sorted(set(targets), key=_target_order))
    not_applied, unknown = [], []
    for engine in choice.engines:
        for target in wanted:
            rule = consumer_rule(engine, version, dialect, target)
            if rule is None:
                unknown.append(f"{engine}: {target}")
            elif rule.status is not _ACCEPTED[target == WHOLE_ADAPTER]:
                not_applied.append(rule)
    return ConsumerVerdict(consumer, version, dialect, tuple(not_applied), tuple(unknown), tuple(versions), defaulted)


#: the status that counts as "works": for a target, applied; for the whole adapter, loaded
_ACCEPTED = {False: ConsumerStatus.APPLIED, True: ConsumerStatus.LOADED}


def _target_order(target: str) -> int:
    order = (*TARGET_LEAVES, MTP)
    return order.index(target) if target in order else len(order)


def require_applied(verdict: ConsumerVerdict) -> None:
    """Fail closed: raise :class:`ConsumerSupportError` naming every target the consumer would not apply."""
    if verdict.ok:
        return
    raise ConsumerSupportError(
        f"exporting for {verdict.consumer} {verdict.version} in the {verdict.dialect} dialect: "
        f"{len(verdict.problems())} target(s) would not be applied: "
        + "; ".join(verdict.problems())
        + ". Nothing was exported. "
        + _platforms_that_apply_all(verdict)
        + "Drop those targets, choose another dialect or consumer, or pass "
        "allow_unapplied=True (--allow-unapplied) to export anyway with them recorded in the adapter's "
        "safetensors metadata (dsv4_consumer)"
    )


def _platforms_that_apply_all(verdict: ConsumerVerdict) -> str:
    """Where a name covers several platforms and some apply every target: the sentence naming them (a user who
    serves only there names that platform), else nothing."""
    engines = consumer_choice(verdict.consumer).engines
    failing = {r.consumer for r in verdict.not_applied} | {u.split(":", 1)[0] for u in verdict.unknown}
    clean = [e for e in engines if e not in failing]
    if len(engines) < 2 or not clean:
        return ""
    named = " or ".join(f"--consumer {e}=={verdict.version}" for e in clean)
    return f"{', '.join(clean)} {verdict.version} applies every target: serving only there, name it ({named}). "


# ------------------------------------------------------------------------- adapters on other modules than the five


def off_target_consequence(kind: str, dialect: str) -> str:
    """What each consumer family does with an adapter holding a LoRA on a module of ``kind`` (anything but the
    five main-attention targets), from the rules above: one clause per family."""
    clauses = []
    for family, choice in CONSUMER_CHOICES.items():
        engine = choice.engines[0]
        versions = tested_versions([engine])
        whole = consumer_rule(engine, versions[-1], dialect, WHOLE_ADAPTER) if versions else None
        if whole is not None and whole.status is not ConsumerStatus.LOADED:
            clauses.append(f"{engine} {whole.version} rejects the whole {dialect}-dialect adapter")
        elif family == "peft" and dialect == "transformers":
            clauses.append(f"PEFT {whole.version} applies it ({OFF_TARGET_PEFT})")
        else:
            clauses.append(f"{engine}: no rule for a {kind} LoRA, nothing vouches it is applied")
    return "; ".join(clauses)

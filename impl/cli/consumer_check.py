"""``dsv4-lora verify-adapter --consumer`` and ``dsv4-lora export --consumer``: an adapter judged by the rules of the
consumer that will load it: :data:`dsv4_conformance.judge.consumers.CONSUMER_RULES`, the judge's table, checked
against the consumers' own code by ``suites/reference/test_consumers.py``. Only a release a lane tested judges; another
is refused with the tested ones listed. Every target the consumer would not apply is one problem line
(:func:`consumer_problems`). The re-publishing export fails closed like the library export (:func:`cmd_export`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.adapter.consumers import (
    CONSUMER_CHOICES,
    MTP,
    WHOLE_ADAPTER,
    ConsumerVerdict,
    consumer_choice,
    consumer_verdict,
    split_consumer,
    tested_versions,
)
from impl.adapter.dialects import PEFT_PREFIX, resolve_module
from impl.adapter.kinds import place_module
from impl.cli import output
from impl.cli.command_text import add_command
from impl.errors import Dsv4Error, ExportError

#: the ``--consumer`` names shown in ``--help`` (each engine of the table is accepted too, e.g. ``vllm/cpu``)
CONSUMER_NAMES = tuple(CONSUMER_CHOICES)


@dataclass
class AdapterTargets:
    """What a consumer check reads from an adapter: its dialect, its targets and the names it could not place."""

    dialect: str | None
    targets: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


def adapter_targets(adapter: str | Path) -> AdapterTargets:
    """Dialect and targets (official leaves, or ``mtp``) of the adapter in ``adapter``, from its header only."""
    from impl.adapter.raw import read_metadata
    from impl.conversion.headers import read_file_header

    file = Path(adapter) / "adapter_model.safetensors"
    if not file.is_file():
        return AdapterTargets(None, problems=[f"{file}: missing (not a PEFT adapter directory)"])
    try:  # headers only, no torch
        names, metadata = [name for name, _ in read_file_header(file)], read_metadata(file)
    except Exception as exc:  # a truncated or foreign file: a problem line, not a traceback
        return AdapterTargets(None, problems=[f"{file}: not readable as safetensors ({type(exc).__name__}: {exc})"])
    found = AdapterTargets(metadata.get("dsv4_dialect"))
    dialects, uncovered = set(), {}
    for name in sorted(names):
        module = name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0]
        ref = resolve_module(module)
        if not name.startswith(PEFT_PREFIX) or ref is None or not ref.row.main:
            place = place_module(module) if name.startswith(PEFT_PREFIX) else None
            uncovered.setdefault(str(place.kind) if place else "unknown", []).append(name)
            continue
        dialects.add(ref.dialect)
        found.targets.add(MTP if ref.layer is None else ref.row.official)
    for kind, listed in uncovered.items():  # one line per kind, not per tensor
        found.problems.append(
            f"{len(listed)} tensors name no main-attention target ({kind}), e.g. {listed[0]}; no consumer rule covers them"
        )
    if len(dialects) > 1:
        found.problems.append(f"{file}: module names mix the dialects {sorted(dialects)}")
    elif dialects and found.dialect not in (None, *dialects):
        found.problems.append(f"{file}: metadata says dialect {found.dialect!r}, the names are {dialects.pop()!r}")
    elif dialects:
        found.dialect = dialects.pop()
    return found


def consumer_problems(adapter: str | Path, consumer: str, version: str | None = None) -> tuple[str, list[str]]:
    """(figure, problems): every target of ``adapter`` that ``consumer`` would not apply, one line each.

    ``verify-adapter --consumer NAME`` reads the adapter's safetensors header only (names and metadata): every module
    is resolved to its dialect and target, and every target the consumer would not apply (loaded but not applied,
    skipped, rejected, routed elsewhere, or with no rule at all) is one problem line.
    """
    found = adapter_targets(adapter)
    if found.dialect is None:
        return "adapter unreadable", found.problems or [f"{adapter}: no adapter modules found"]
    try:
        verdict: ConsumerVerdict = consumer_verdict(consumer, found.dialect, found.targets, version)
    except Dsv4Error as exc:
        return "no rules", [f"{type(exc).__name__}: {exc}"]
    problems = found.problems + _by_cause(verdict) + _way_forward(adapter, consumer, found, verdict)
    applied = f"{_applied(verdict, found.targets)}/{len(found.targets)} target(s) applied"
    return f"{verdict.release_note()}, {found.dialect} dialect: {applied}", problems


def _applied(verdict: ConsumerVerdict, targets: set[str]) -> int:
    missed = {r.target for r in verdict.not_applied}
    return 0 if WHOLE_ADAPTER in missed else len(targets - missed)  # a refused adapter applies nothing


def _by_cause(verdict: ConsumerVerdict) -> list[str]:
    """One line per cause (the same status and reason, on any engine and target), with a count where it has many."""
    causes: dict[tuple[str, str | None, str], list[tuple[str, str]]] = {}
    for r in verdict.not_applied:
        causes.setdefault((str(r.status), r.routed_to, r.why), []).append((r.consumer, r.target))
    lines = []
    for (status, routed_to, why), cells in causes.items():
        engines = ", ".join(dict.fromkeys(engine for engine, _ in cells))
        targets = list(dict.fromkeys(target for _, target in cells))
        head = f"{engines} {verdict.version} ({verdict.dialect} dialect)"
        route = f" -> {routed_to}" if routed_to else ""
        if len(targets) == 1:
            lines.append(f"{head}: {targets[0]}: {status}{route}: {why}")
        else:
            lines.append(f"{head}: {len(targets)} targets {status}{route} ({', '.join(targets)}): {why}")
    return lines + [p for p in verdict.problems() if "no rule in" in p]


def _way_forward(adapter: str | Path, consumer: str, found: AdapterTargets, verdict: ConsumerVerdict) -> list[str]:
    """Where ``dsv4-lora export --consumer`` would do better (the consumer's own naming), the command that does it."""
    choice = consumer_choice(consumer)
    if verdict.ok or found.dialect == choice.dialect:
        return []
    better = consumer_verdict(consumer, choice.dialect, found.targets, verdict.version)
    applied = _applied(better, found.targets)
    if applied <= _applied(verdict, found.targets):
        return []
    still = sorted({r.target for r in better.not_applied})
    rest = f"; it would still not apply {', '.join(still)} (export refuses unless --allow-unapplied)" if still else ""
    return [
        f"re-publish it in {consumer}'s naming ({choice.dialect} dialect), where {applied}/{len(found.targets)} "
        f"target(s) are applied: dsv4-lora export --adapter {adapter} --out <new dir> --consumer {consumer}{rest}"
    ]


def add_consumer_check(result, adapter: str | Path, consumer: str, version: str | None) -> None:
    """Append the ``consumer`` check and its problems to a :class:`impl.cli.verify.VerifyResult`."""
    from impl.cli.verify import VerifyCheck

    figure, problems = consumer_problems(adapter, consumer, version)
    result.checks.append(VerifyCheck("consumer", not problems, figure))
    result.problems += [f"consumer: {p}" for p in problems]


def add_consumer_arguments(parser: argparse.ArgumentParser, *, export: bool) -> None:
    """``--consumer`` (and ``--consumer-version``) on ``verify-adapter``; required on ``export``.

    ``--consumer NAME`` judges by the newest engine release impl holds rules for (one a lane tested; the command
    prints which, and the tested ones); ``--consumer NAME==RELEASE`` (or ``--consumer-version``) names another tested
    release, and a release no lane ran is refused with the tested ones listed.
    """
    parser.add_argument(
        "--consumer",
        required=export,
        metavar="{" + "|".join(CONSUMER_NAMES) + "}[==RELEASE]",
        help="judge the adapter by this consumer's rules (impl.CONSUMER_RULES, checked against its own code); "
        "an engine variant such as vllm/cpu is accepted too; ==RELEASE names a tested release (e.g. vllm==0.34.0)",
    )
    parser.add_argument(
        "--consumer-version", default=None, help="the release, as ==RELEASE; default: the newest tested release"
    )


def cmd_export(args: argparse.Namespace) -> int:
    """``dsv4-lora export``: re-publish an adapter for a consumer; exit 1 (nothing published) when it refuses.

    ``export --adapter SRC --out DST --consumer NAME`` goes through the collective export (world of one): SRC is
    validated, its tensors renamed back to the native names and exported in the consumer's dialect, failing closed
    exactly like the library export (nothing published) unless ``--allow-unapplied`` records what the consumer would
    not apply in the safetensors metadata ``dsv4_consumer``.
    """
    from impl.adapter.export import export_adapter

    try:
        dialect = args.dialect or consumer_choice(args.consumer).dialect
        print(f"consumer: {_release(args)}")
        state, options = _source_state(Path(args.adapter))
        out = export_adapter(
            state,
            args.out,
            dialect=dialect,
            mtp=args.mtp,
            consumer=args.consumer,
            consumer_version=args.consumer_version,
            allow_unapplied=args.allow_unapplied,
            **options,
        )
    except (Dsv4Error, OSError, ValueError, KeyError) as exc:  # bad input: one line naming it, never a traceback
        cause = exc.__cause__ if isinstance(exc.__cause__, Dsv4Error) else exc
        output.problem(f"export FAILED: {type(cause).__name__}: {cause}")  # the person's terminal, not the log
        return 1
    recorded = json.loads(_metadata(out).get("dsv4_consumer", "{}"))
    unapplied = recorded.get("unapplied", []) + recorded.get("unknown", [])
    print(
        f"exported {args.adapter} for {recorded.get('consumer')} {recorded.get('version')} ({dialect} dialect) to {out}"
    )
    for item in unapplied:
        print(f"  recorded as not applied: {item}")
    return 0


def _release(args: argparse.Namespace) -> str:
    """The release that judges: ``vllm 0.34.0``, saying whether it is the default (the newest tested release), with
    the tested ones."""
    name, named = split_consumer(args.consumer, args.consumer_version)
    tested = tested_versions(consumer_choice(name).engines)
    version = named or (tested[-1] if tested else "(none)")
    how = "the newest tested release" if not named else "the release named" if named in tested else "no lane ran it"
    return f"{name} {version} ({how}; tested: {', '.join(tested)}; name one with {name}==RELEASE)"


def _source_state(src: Path):
    """The native adapter state of an existing adapter directory (validated first), and the export options it
    carries over (base name, fingerprint)."""
    from impl.adapter.build import AdapterState
    from impl.adapter.dialects import native_name
    from impl.adapter.fingerprint import METADATA_KEY
    from impl.adapter.validation import AdapterDir, lora_scale, validate_adapter_dir

    validate_adapter_dir(src, require_complete=False)
    view = AdapterDir(src, require_complete=False)
    tensors = {}
    for module, halves in view.modules.items():
        ref = resolve_module(module)
        if ref is None or not ref.row.main:
            place = place_module(module)
            raise ExportError(
                f"{src}: {module} is {'a ' + str(place.kind) + ' module' if place else 'no V4 module'}; only the "
                "main-attention targets are exportable (drop it, or use the adapter with PEFT as it is)"
            )
        for half, key in (("A", "lora_A"), ("B", "lora_B")):
            tensors[native_name(ref.layer, ref.row, half)] = halves[key].torch()
    cfg = view.config
    # the native state scales by alpha/r: an rsLoRA adapter's alpha/sqrt(r) is carried as the equivalent alpha
    alpha = lora_scale(cfg) * cfg["r"] if cfg.get("use_rslora") else cfg["lora_alpha"]
    state = AdapterState(tensors, r=cfg["r"], alpha=alpha, dropout=cfg.get("lora_dropout", 0.0))
    fingerprint = view.metadata.get(METADATA_KEY)
    options = {
        "base_model_name_or_path": cfg.get("base_model_name_or_path"),
        "base_fingerprint": json.loads(fingerprint) if fingerprint else None,
    }
    return state, options


def _metadata(adapter: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        return f.metadata() or {}


def add_export_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``dsv4-lora export`` (``parents``: the options every command shares)."""
    e = add_command(sub, "export", parents)
    e.add_argument("--adapter", required=True, help="source PEFT adapter directory")
    e.add_argument("--out", required=True, help="destination directory (replaced atomically)")
    add_consumer_arguments(e, export=True)
    e.add_argument(
        "--dialect", default=None, choices=["transformers", "official", "sglang"], help="default: the consumer's"
    )
    e.add_argument("--mtp", default="reject", choices=["reject", "exclude"], help="MTP the dialect cannot express")
    e.add_argument("--allow-unapplied", action="store_true", help="export anyway; record what would not apply")
    e.set_defaults(func=cmd_export)

"""``dsv4-lora``: qualify a DeepSeek-V4 LoRA setup end to end, check an adapter, report mapping coverage."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dsv4_launcher.errors import LauncherError
from impl.cli import output
from impl.cli.command_text import add_command
from impl.cli.consumer_check import add_consumer_arguments, add_export_parser
from impl.cli.convert import add_convert_parser
from impl.errors import Dsv4Error, OutputPathError, UsageError
from impl.vocabulary import TARGET_TABLE, TargetTable

__all__ = [
    "build_parser",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_PRESET = "tiny-mixed"


def _print_problems(problems: list[str]) -> int:
    """Bad input as the user sees it: one line per problem, each naming its file, then the verdict (exit 1)."""
    for problem in problems:
        print(f"  problem: {problem}")
    print(f"\nFAILED: {len(problems)} problem(s)")
    return EXIT_FAILED


def _output_dir(path: str) -> Path:
    """``--out`` created and writable, or :class:`OutputPathError` naming it and why."""
    out = Path(path).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dsv4-lora-write-probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise OutputPathError(f"--out {out}: not a writable directory ({exc.strerror or type(exc).__name__})") from None
    return out


def _positive(kind: type, *, zero: bool = False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"{text} must be {'non-negative' if zero else 'positive'}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _print_table(rows: list[tuple[str, str, str]]) -> None:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for name, status, figure in rows:
        print(f"  {name:<{w0}}  {status:<{w1}}  {figure}")


def _status(passed: bool | None, inconclusive: bool = False) -> str:
    if inconclusive:
        return "INCONCLUSIVE"
    return "PASS" if passed else ("n/a" if passed is None else "FAIL")


def check_qualify_usage(args: argparse.Namespace) -> None:
    """qualify's arguments that cannot work, before anything is created (:class:`UsageError`, exit 2); sets
    ``args.target_list`` and ``args.ranks``."""
    args.target_list = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not args.target_list:
        raise UsageError(f"--targets {args.targets!r} names no target; give comma-separated names such as wq_a,wo_b")
    args.driver = args.driver or DEFAULT_DRIVER
    from dsv4_lora.qualify_driver import find_driver

    try:
        driver = find_driver(args.driver)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.dialect not in driver.dialects:
        raise UsageError(
            f"--dialect {args.dialect}: driver {args.driver} declares the dialects {sorted(driver.dialects)} "
            "(its `dialects`); choose one of them"
        )
    args.ranks = args.nproc or args.tp * args.pp * args.ep
    if args.ranks % (args.tp * args.pp) or args.ranks % (args.ep * args.pp):
        raise UsageError(
            f"--nproc {args.ranks} ranks cannot hold TP={args.tp} x PP={args.pp} (dense) and EP={args.ep} x "
            f"PP={args.pp} (experts); use a multiple of both"
        )
    if args.base is None and args.preset != DEFAULT_PRESET:  # the default needs no check (nor transformers' import)
        from tiny_models.presets import PRESETS

        if args.preset not in PRESETS:
            raise UsageError(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")


#: the driver ``qualify`` runs without ``--driver``: this implementation's own (the package this command line is in,
#: so a mutated copy's command line runs the copy)
DEFAULT_DRIVER = f"{__package__.partition('.')[0]}.driver"
#: qualify's options a driver's run takes as they are
_DRIVER_RUN_OPTIONS = ("targets", "rank", "alpha", "tp", "ep", "pp", "dtype", "steps", "seed", "dialect")


def cmd_qualify(args: argparse.Namespace) -> int:
    from dsv4_lora.qualify_driver import Check, DefaultBase, run_options, versions
    from impl.cli.tested import untested_line, untested_versions

    nproc = args.ranks
    out = _output_dir(args.out)
    base, default_base = args.base, None
    if base is None:
        base = str(out / "base")
        default_base = DefaultBase(args.preset, args.seed, base)
        print(f"the embedded default base (deterministic tiny V4, preset {args.preset}) goes to {base}")
    opts = {name: getattr(args, name) for name in _DRIVER_RUN_OPTIONS}
    opts.update(targets=args.target_list, base=str(Path(base).resolve()), out=str(out))
    opts.update(timeout_s=args.timeout, oracle=not args.no_oracle, preset=None if args.base else args.preset)
    print(
        f"qualify: base={opts['base']} tp={args.tp} ep={args.ep} pp={args.pp} ranks={nproc} "
        f"targets={','.join(args.target_list)} driver={args.driver}"
    )
    t0 = time.perf_counter()
    try:
        checks = _qualify_driver(args, opts, nproc, default_base)
        error = None
    except Exception as exc:  # report, don't traceback: the JSON still records what ran
        checks, error = [], f"{type(exc).__name__}: {exc}"
        root = getattr(exc, "root_cause", None)  # a rank failed: its own error, not the launcher's summary
        headline = f"rank {root.rank} {root.summary()}" if root is not None else error.splitlines()[0]
    wall = time.perf_counter() - t0
    if error:
        checks.append(Check("run", False, headline[:300], {"error": error}, 0.0))
    print()
    _print_table(
        [("check", "result", "figure")] + [(c.name, _status(c.passed, c.inconclusive), c.figure) for c in checks]
    )
    ok = bool(checks) and all(c.passed is not False for c in checks)
    installed = versions()
    untested = untested_line(installed)
    if untested:  # not an error: the figures were only ever measured on the lanes' versions
        print(untested)
    report = {
        "ok": ok,
        "driver": args.driver,
        "wall_s": round(wall, 2),
        "options": {**opts, "targets": list(args.target_list), "nproc": nproc, **run_options()},
        "versions": installed,
        "untested_versions": untested_versions(installed),
        "checks": [c.__dict__ for c in checks],
        "adapter": str(out / "adapter"),
    }
    json_path = Path(args.json) if args.json else out / "qualify.json"
    json_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{'PASSED' if ok else 'FAILED'} in {wall:.1f}s; report: {json_path}; adapter: {out / 'adapter'}")
    print(f"log (library output, every rank): {args.log}")
    if error:
        output.problem(f"error: {headline[:300]} (details: {args.log})")
    return EXIT_OK if ok else EXIT_FAILED


def _qualify_driver(args: argparse.Namespace, opts: dict[str, Any], nproc: int, default_base: Any) -> list[Any]:
    """The implementation behind the driver, judged by the conformance judge alone (``dsv4_lora``, which reaches no
    implementation but through its driver). A given base is first read by the judge (config and headers): a damaged
    one is named before any rank starts."""
    from dsv4_conformance.judge.base import base_layout, base_problems
    from dsv4_lora.qualify_driver import STEP_COUNT, Check, driver_run, qualify_driver

    if default_base is None:
        problems = base_problems(opts["base"])
        if problems:
            said = [str(p) for p in problems]
            return [Check(problems[0].check, False, "; ".join(said)[:300], {"problems": said})]
        print(f"base: {base_layout(opts['base'])}")
    run = driver_run(args.driver, opts["base"], opts["out"], **{k: opts[k] for k in _DRIVER_RUN_OPTIONS})
    output.declare_steps(STEP_COUNT)
    t0 = time.perf_counter()
    started = f"start {nproc} rank{'s' * (nproc > 1)} of driver {args.driver}"
    return qualify_driver(
        args.driver,
        run,
        nproc=nproc,
        timeout_s=opts["timeout_s"],
        oracle=opts["oracle"],
        preload=() if default_base is None else (default_base,),
        before_go=lambda: output.step(started, time.perf_counter() - t0),
        step=output.step,
    )


def cmd_verify_adapter(args: argparse.Namespace) -> int:
    from impl.cli.verify import verify_adapter

    result = verify_adapter(
        args.base,
        args.adapter,
        forward=args.forward,
        judge=args.judge,
        require_certified=args.require_certified,
        full_hash=args.full_hash,
    )
    if args.consumer:  # the consumer's rules: one problem per target it would not apply
        from impl.cli.consumer_check import add_consumer_check

        add_consumer_check(result, args.adapter, args.consumer, args.consumer_version)
    rows = [(c.name, c.status or _status(c.passed), c.figure) for c in result.checks]
    _print_table([("check", "result", "detail")] + rows)
    for problem in result.problems:
        print(f"  problem: {problem}")
    verdict = "PASSED" if result.ok else "FAILED"
    if result.ok and result.uncertified:  # sound, but its base and completeness cannot be proven
        verdict = "PASSED, UNCERTIFIED (--require-certified refuses it)"
    print(f"\n{verdict}: {len(result.problems)} problem(s)")
    return EXIT_OK if result.ok else EXIT_FAILED


def cmd_coverage(args: argparse.Namespace) -> int:
    from impl.conversion.coverage import coverage_report

    if args.base:
        from impl.conversion.base_dir import inspect_base
        from impl.conversion.mapping_table import ManifestFacts

        read = inspect_base(args.base)
        if read.ok and ManifestFacts.from_published(read.config or {}) is None:  # a form only transformers folds
            read = inspect_base(args.base, transformers_config=True)
        if not read.ok:
            return _print_problems([p.message for p in read.problems])
        report = coverage_report(Path(args.base), layout=args.layout)
    else:
        from tiny_models.manifest import manifest
        from tiny_models.presets import PRESETS, flash_config, get_preset, pro_config

        if args.manifest not in ("flash", "pro", *PRESETS):
            raise UsageError(f"--manifest {args.manifest!r}: choose flash, pro or a tiny preset {sorted(PRESETS)}")
        cfg = {"flash": flash_config, "pro": pro_config}.get(args.manifest)
        cfg = cfg() if cfg else get_preset(args.manifest)
        report = coverage_report(
            [s.name for s in manifest(cfg, with_scales=args.manifest in ("flash", "pro"))],
            config=cfg,
            layout=args.layout,
        )
    print(report.table(limit=args.limit))
    totals = report.totals
    print("totals: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    ok = totals.get("unmapped", 0) == 0 and totals.get("missing", 0) == 0
    return EXIT_OK if ok else EXIT_FAILED


def _output_options() -> argparse.ArgumentParser:
    """Every command's ``-v/--verbose`` and ``--log`` (see :mod:`impl.cli.output`)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show library output (warnings, logs, progress bars, every rank) on the terminal",
    )
    common.add_argument(
        "--log",
        default=None,
        help=f"log file for library output (default: OUT/{output.LOG_NAME}, or one file per command in the temp dir)",
    )
    return common


def build_parser(table: TargetTable = TARGET_TABLE) -> argparse.ArgumentParser:
    """The ``dsv4-lora`` argument parser; ``qualify --targets`` defaults to ``table``'s main-attention targets."""
    parser = argparse.ArgumentParser(
        prog="dsv4-lora",
        description="Prove a DeepSeek-V4 LoRA setup end to end (Megatron-Core native graph, Megatron-Bridge "
        "conversion, PEFT adapter export and reload).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = _output_options()

    q = add_command(sub, "qualify", [common])
    q.add_argument("--base", help="official-layout checkpoint directory (default: write a tiny base into --out)")
    q.add_argument(
        "--preset", default=DEFAULT_PRESET, help=f"tiny preset for the default base (default: {DEFAULT_PRESET})"
    )
    q.add_argument("--targets", default=",".join(table.main_names), help="comma-separated LoRA targets")
    q.add_argument("--rank", type=_positive(int), default=8, help="LoRA rank r (default 8)")
    q.add_argument("--alpha", type=_positive(float), default=16.0, help="LoRA alpha (default 16)")
    q.add_argument("--tp", type=_positive(int), default=1, help="tensor parallel size")
    q.add_argument("--ep", type=_positive(int), default=1, help="expert parallel size")
    q.add_argument("--pp", type=_positive(int), default=1, help="pipeline parallel size")
    q.add_argument(
        "--nproc", type=_positive(int), default=None, help="ranks (default tp*pp*ep; gloo on CPU, NCCL under torchrun)"
    )
    q.add_argument("--dialect", default="transformers", choices=["transformers", "official", "sglang"])
    q.add_argument("--steps", type=_positive(int), default=3, help="optimizer steps (default 3)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--no-oracle",
        action="store_true",
        help="skip the transformers comparisons (base_logits, reload): a full-size oracle does not fit one host",
    )
    q.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="parameter dtype (bf16: base logits compared by mean |Δ|, the reload in float32; see dsv4_conformance.judge.oracle)",
    )
    q.add_argument(
        "--driver",
        default=None,
        metavar="MODULE",
        help="qualify the implementation behind this driver module (its DRIVER, dsv4_conformance.driver), judged "
        f"by the conformance judge (default: this implementation's own, {DEFAULT_DRIVER})",
    )
    q.add_argument("--timeout", type=_positive(float), default=900.0, help="seconds before every rank is stopped")
    q.add_argument("--out", default="out/qualify", help="output directory (adapter, base, report)")
    q.add_argument("--json", default=None, help="JSON report path (default OUT/qualify.json)")
    q.set_defaults(func=cmd_qualify, check_usage=check_qualify_usage)

    _add_verify_parser(sub, common)
    add_export_parser(sub, parents=[common])
    add_convert_parser(sub, parents=[common])
    _add_coverage_parser(sub, common)
    return parser


def _add_verify_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    v = add_command(sub, "verify-adapter", [common])
    v.add_argument("--base", required=True, help="base checkpoint directory")
    v.add_argument("--adapter", required=True, help="PEFT adapter directory")
    v.add_argument("--forward", action="store_true", help="also run the tiny logits check (small bases only)")
    v.add_argument(
        "--judge",
        action="store_true",
        help="also ask the conformance judge (dsv4_conformance.judge, the suites' own; implied by --forward)",
    )
    v.add_argument(
        "--require-certified",
        action="store_true",
        help="exit 1 for an adapter without .complete or base fingerprint (a third-party adapter)",
    )
    v.add_argument(
        "--full-hash",
        action="store_true",
        help="compare the fingerprint by every byte of the targeted base weights (default: by every byte where "
        "their digests are remembered from an earlier run, else by 64 sampled pages of each large weight)",
    )
    add_consumer_arguments(v, export=False)
    v.set_defaults(func=cmd_verify_adapter)


def _add_coverage_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    c = add_command(sub, "coverage", [common])
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--base", help="checkpoint directory")
    src.add_argument("--manifest", help="flash, pro, or a tiny preset name")
    c.add_argument("--limit", type=_positive(int, zero=True), default=30, help="table rows to print (default 30)")
    c.add_argument(
        "--layout",
        default="miles",
        choices=["miles", "upstream"],
        help="native names to report: the Miles graph this tool builds (default) or upstream Megatron-Core's "
        "dsv4_hybrid (Megatron-Bridge's DeepSeekV4Bridge names)",
    )
    c.set_defaults(func=cmd_coverage)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input ends as problem lines and exit 1 (2 for usage), never a traceback: every
    command raises typed :class:`Dsv4Error` s naming the file; an OS error names its file too."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import impl  # noqa: F401  (CPU compat layer before any megatron import)

    if getattr(args, "check_usage", None) is not None:  # before the log or --out is created
        try:
            args.check_usage(args)
        except UsageError as exc:
            output.problem(f"dsv4-lora {args.command}: error: {exc}")
            return EXIT_USAGE
    # Only qualify's --out is a report directory; export's is the adapter, which must hold nothing else.
    report_dir = args.out if args.command == "qualify" else None
    if report_dir is not None and args.log is None:
        try:
            _output_dir(report_dir)
        except OutputPathError as exc:
            return _print_problems([f"{exc} ({type(exc).__name__})"])
    args.log = Path(args.log or output.default_log_path(args.command, report_dir)).resolve()
    try:
        console = output.Console(args.log, verbose=args.verbose)
        console.__enter__()
    except OSError as exc:
        where = getattr(exc, "filename", None) or args.log
        output.problem(
            f"error: cannot write the log file {where}: {exc.strerror or exc} (choose another --log or --out)"
        )
        return EXIT_FAILED
    try:
        return console.run(_run_command, args)
    finally:
        console.__exit__(None, None, None)


def _run_command(args: argparse.Namespace) -> int:
    """Bad input as problem lines: usage (exit 2), a typed error or an OS error naming its file (exit 1)."""
    try:
        return args.func(args)
    except UsageError as exc:
        output.problem(f"dsv4-lora {args.command}: error: {exc}")
        return EXIT_USAGE
    except (Dsv4Error, LauncherError) as exc:
        return _print_problems([f"{exc} ({type(exc).__name__})"])
    except OSError as exc:  # a file a command reads or writes; the OS names it
        where = f"{exc.filename}: " if exc.filename else ""
        return _print_problems([f"{where}{exc.strerror or exc} ({type(exc).__name__})"])


if __name__ == "__main__":
    sys.exit(main())

"""What ``dsv4-lora qualify``'s two sides share: its options, the :class:`Check` each step records, and the checks of
the base's headers (``detect``, ``coverage``) that the launcher runs before any rank starts and every rank runs
again. The launcher (:mod:`impl.cli.qualify`) and the ranks (:mod:`impl.cli.qualify_rank`) both import it, so the
ranks never import the launcher (which imports the ranks' module only when it starts them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from impl.vocabulary import TARGET_TABLE

__all__ = [
    "QualifyOptions",
]

DEFAULT_TARGETS = TARGET_TABLE.main_names


@dataclass(frozen=True)
class QualifyOptions:
    base: str
    out: str
    targets: tuple[str, ...] = DEFAULT_TARGETS
    rank: int = 8
    alpha: float = 16.0
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dialect: str = "transformers"
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    batch: int = 2
    seq_len: int | None = None
    timeout_s: float = 900.0
    oracle: bool = True  # compare with transformers (tiny bases; a full-size oracle does not fit one host)
    dtype: str = "float32"  # parameter dtype, a key of the judge's LOGIT_RULES


@dataclass
class Check:
    name: str
    passed: bool | None  # None: not applicable in this configuration
    figure: str
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    inconclusive: bool = False  # not passed: the comparison could not have seen the defects it claims to catch


def all_passed(checks: list[Check]) -> bool:
    return all(c.passed for c in checks)


def header_checks(read: Any) -> list[Check]:
    """``detect`` (and ``base`` when the directory has problems) from :func:`inspect_base`'s headers-only read."""
    from impl.conversion.detect import is_deepseek_v4_config

    problems = [p.message for p in read.problems]
    if read.config is None or not is_deepseek_v4_config(read.config):
        return [Check("detect", False, problems[0], {"problems": problems}, 0.0)]
    checks = [Check("detect", True, f"architectures[0]={read.config['architectures'][0]}", {}, 0.0)]
    if problems:
        checks.append(Check("base", False, "; ".join(problems), {"problems": problems}, 0.0))
    return checks


def base_checks(base: Path) -> list[Check]:
    """``detect`` and ``coverage``: the config and the safetensors headers (every rank: cheap, and every rank must
    know to stop)."""
    from impl.conversion.base_dir import inspect_base
    from impl.conversion.coverage import coverage_report
    from impl.errors import Dsv4Error

    t0 = time.perf_counter()
    checks = header_checks(inspect_base(base, transformers_config=True))
    if not all_passed(checks):
        return checks
    try:
        cov = coverage_report(base)
    except Dsv4Error as exc:  # e.g. a corrupt safetensors file: the check fails with the problem, no traceback
        return [*checks, Check("coverage", False, str(exc), {}, round(time.perf_counter() - t0, 3))]
    tot = cov.totals
    checks.append(
        Check(
            "coverage",
            tot.get("unmapped", 0) == 0 and tot.get("missing", 0) == 0,
            ", ".join(f"{k} {v}" for k, v in tot.items())
            + "".join(
                f"; {kind}: {', '.join(names[:5])}"
                for kind, names in (("unmapped", cov.unmapped), ("missing", cov.missing))
                if names
            )
            + (f"; {cov.base_layout} layout (save_pretrained), no MTP" if cov.base_layout != "official" else ""),
            {
                "totals": tot,
                "unmapped": cov.unmapped[:20],
                "missing": cov.missing[:20],
                "base_layout": str(cov.base_layout),
            },
            round(time.perf_counter() - t0, 3),
        )
    )
    return checks

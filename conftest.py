"""Suite-wide configuration: markers, options, hypothesis profiles, the ``impl`` fixture.

Markers: every test carries one of ``cpu`` / ``gpu`` / ``gpu32`` / ``bench``; an unmarked test is a
usage error. ``gpu`` and ``gpu32`` tests are skipped (with the reason) where CUDA is absent, except in the CPU
rehearsal (``--rehearse`` under torchrun); their ranks are NCCL ranks, never gloo ones (``fixtures/runner/rank_session.py``).
"""

from __future__ import annotations

import functools
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from fixtures.contract.capabilities import skip_undeclared
from fixtures.runner.impl_loader import load_impl, resolve_impl_name
from fixtures.runner.pins import PIN_INDEPENDENT
from fixtures.runner.xfails import read_xfail_lines

pytest_plugins = [
    "fixtures.data.tiny_checkpoint_cache",
    "fixtures.runner.rank_session",
    "fixtures.data.sparse_checkpoint",
    "fixtures.conformance.plugin",
    "fixtures.runner.qualify_runs",
]

REQUIRED_MARKERS = ("cpu", "gpu", "gpu32", "bench")
MARKERS = {
    "cpu": "runs on a CPU-only host (gloo)",
    "gpu": "needs CUDA (NCCL under torchrun with --nproc)",
    "gpu32": "a full-size 32-rank run on the real checkpoint (DSV4_FLASH_CHECKPOINT)",
    "slow": "takes more than a few seconds",
    "bench": "a benchmark that prints figures; never asserts on time",
    "multirank": "spawns several ranks through fixtures.runner.multirank",
    "pin_independent": "never imports megatron: runs once, not per Megatron-Bridge pin (fixtures/runner/pins.py)",
    "harness": "tests the suite's own machinery (suites/meta/, and tests marked so: the runner's GPU guard, the "
    "device check script): a Megatron-Bridge pin changes none of it",
    "bridge_path": "a command-line run through the whole bridge path (qualify: strict load, LoRA, gather, export, "
    "reload): a Bridge pin runs it although it is slow",
    "transformers": "its file uses transformers or PEFT (the oracle, reloads, PEFT producers): found in its source",
    "consumer_env": "runs another project's code in its own environment (.consumers/: vLLM, SGLang): a lane that "
    "changes only this project's side (the latest lane) leaves it to the main lane",
}
#: what marks a test file ``transformers`` (the latest lane's Bridge half runs those)
_USES_TRANSFORMERS = re.compile(r"\b(load_oracle|transformers|peft|PeftModel)\b")

settings.register_profile(
    "dev", max_examples=20, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=50,
    deadline=None,
    print_blob=True,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# a conformance report's run (fixtures/contract/conformance.py): as ci, without shrinking and with fewer examples: a
# report names the exception a property test meets first, not the smallest example of each, and shrinking is most of
# such a run's time
settings.register_profile(
    "report", settings.get_profile("ci"), phases=(Phase.explicit, Phase.reuse, Phase.generate), max_examples=10
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dsv4", "DeepSeek-V4 LoRA conformance")
    group.addoption(
        "--nproc",
        type=int,
        default=None,
        help="ranks for distributed tests (default: WORLD_SIZE under torchrun, else $DSV4_NPROC, else 2)",
    )
    group.addoption("--impl", default=None, help="implementation module under test (default: impl, or $DSV4_IMPL)")
    group.addoption("--max-examples", type=int, default=None, help="override the profile's max_examples")
    group.addoption(
        "--xfails-file",
        default=None,
        help="known gaps: '<node-id prefix> <exception>' per line ('# reason: ...' comments); "
        "matches get xfail(strict=True, raises=<exception>)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under -n 2 on a 2-core host each worker owns one core; torch's default threading oversubscribes it
    (docs/performance.md). DSV4_TORCH_THREADS overrides. Set before a test's fixtures, once torch is loaded: a
    pytest process that never loads torch (xdist's controller, a run of a generated file) never pays for its
    import."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(item.config, "dsv4_torch_threads", None) is None:
        item.config.dsv4_torch_threads = int(os.environ.get("DSV4_TORCH_THREADS", "1"))
        torch.set_num_threads(item.config.dsv4_torch_threads)


def pytest_configure(config: pytest.Config) -> None:
    # The processes tests start (the command line, its ranks, the engines' probes) take the suite's thread count
    # too: with torch's default each oversubscribes a core that another xdist worker is using.
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("DSV4_TORCH_THREADS", "1"))
    # Base digests remembered by the suite's thousands of throwaway bases stay out of the user's own cache.
    os.environ.setdefault("DSV4_LORA_CACHE", os.path.join(tempfile.gettempdir(), f"dsv4-lora-test-cache-{os.getuid()}"))
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    # hypothesis' own --hypothesis-profile wins; otherwise $HYPOTHESIS_PROFILE, else dev.
    profile = config.getoption("hypothesis_profile", None) or os.environ.get("HYPOTHESIS_PROFILE") or "dev"
    settings.load_profile(profile)
    max_examples = config.getoption("max_examples")
    if max_examples is not None:
        settings.register_profile("dsv4-override", settings(settings.get_profile(profile), max_examples=max_examples))
        settings.load_profile("dsv4-override")
    config.dsv4_profile = profile


def pytest_report_header(config: pytest.Config) -> list[str]:
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "absent"

    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("DSV4_", "HYPOTHESIS_")))
    return [
        f"dsv4: impl={resolve_impl_name(config.getoption('impl'))} nproc={nproc_of(config)} "
        f"hypothesis-profile={config.dsv4_profile} max_examples={settings.default.max_examples}",
        "dsv4: "
        + " ".join(
            f"{d}={version(d)}"
            for d in ("torch", "megatron-core", "megatron-bridge", "transformers", "peft", "safetensors")
        ),
        f"dsv4: env {' '.join(env) if env else '(no DSV4_*/HYPOTHESIS_* variables)'}",
    ]


def nproc_of(config: pytest.Config) -> int:
    """--nproc, else torchrun's WORLD_SIZE (which --nproc must then equal), else $DSV4_NPROC, else 2."""
    from fixtures.runner.multirank import launched_world

    value, world = config.getoption("nproc"), launched_world()
    if world is not None:
        if value is not None and value != world.world_size:
            raise pytest.UsageError(
                f"--nproc {value} under torchrun with WORLD_SIZE={world.world_size}: they must agree"
            )
        return world.world_size
    if value is not None:
        return value
    return int(os.environ.get("DSV4_NPROC", "2"))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing or broken: no CUDA either way
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(m) for m in REQUIRED_MARKERS)]
    if unmarked:
        raise pytest.UsageError(
            "tests without one of the markers " + ", ".join(REQUIRED_MARKERS) + ":\n  " + "\n  ".join(unmarked)
        )
    _apply_xfails_file(config, items)
    skip_undeclared(resolve_impl_name(config.getoption("impl")), items)
    for item in items:
        if item.nodeid.split("::")[0] in PIN_INDEPENDENT:
            item.add_marker(pytest.mark.pin_independent)
        if item.nodeid.startswith("suites/meta/"):
            item.add_marker(pytest.mark.harness)
        if _uses_transformers(str(item.path)):
            item.add_marker(pytest.mark.transformers)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") or item.get_closest_marker("gpu32")]
    if gpu_items and not config.getoption("rehearse") and not _cuda_available():  # torch only where it decides
        skip = pytest.mark.skip(
            reason="needs CUDA: torch.cuda.is_available() is False on this host "
            "(rehearse on the CPU: torchrun --nproc-per-node 4 -m pytest -m gpu --rehearse)"
        )
        for item in gpu_items:
            item.add_marker(skip)


def _apply_xfails_file(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the node ids listed in --xfails-file xfail(strict=True, raises=<the exception the line names>).

    Format: one ``<node-id prefix> <exception>`` per line. The exception is a builtin name (``ModuleNotFoundError``),
    ``impl.<Name>`` (that name in the implementation under test, as ``--impl`` / ``DSV4_IMPL`` resolves it) or a
    dotted ``module.Name``. ``# reason: ...`` sets the reason for the lines below it; other ``#`` lines are comments.
    A listed test that passes, or fails with another exception, fails the run. A line without a known exception
    type, or whose file was collected but that matches no test (a typo or a renamed test), is a usage error; lines
    for files outside this run's selection are ignored, so the file also works for a subset.
    """
    path = config.getoption("xfails_file")
    if not path:
        return
    entries = _read_xfails_file(config, path)
    files = {item.nodeid.split("::")[0] for item in items}
    unmatched = [
        prefix
        for prefix, _, _ in entries
        if prefix.split("::")[0] in files and not any(item.nodeid.startswith(prefix) for item in items)
    ]
    if unmatched:
        raise pytest.UsageError(f"{path}: entries that match no collected test:\n  " + "\n  ".join(unmatched))
    for item in items:
        for prefix, raises, why in entries:
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xfail(reason=why, strict=True, raises=raises))
                break


@functools.cache
def _uses_transformers(path: str) -> bool:
    return bool(_USES_TRANSFORMERS.search(Path(path).read_text()))


def _read_xfails_file(config: pytest.Config, path: str) -> list[tuple[str, type[BaseException], str]]:
    """``(node-id prefix, expected exception type, reason)`` per entry line of an xfails file."""
    return [
        (line.prefix, _exception_type(config, line.exception, line.where), f"{line.reason} ({line.exception})")
        for line in read_xfail_lines(path)
    ]


def _exception_type(config: pytest.Config, name: str, where: str) -> type[BaseException]:
    """The exception class an xfails line names: a builtin, ``impl.<Name>`` (the implementation under test) or a
    dotted ``module.Name``."""
    import builtins
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        if not module:
            value = getattr(builtins, attr)
        elif module == "impl":
            value = getattr(load_impl(resolve_impl_name(config.getoption("impl"))).module, attr)
        else:
            value = getattr(importlib.import_module(module), attr)
    except (AttributeError, ImportError) as exc:
        raise pytest.UsageError(f"{where}: cannot find the exception {name!r}: {exc}") from None
    if not (isinstance(value, type) and issubclass(value, BaseException)):
        raise pytest.UsageError(f"{where}: {name!r} is not an exception type")
    return value


@pytest.fixture(scope="session")
def impl(pytestconfig: pytest.Config):
    """The implementation under test, resolved once from --impl / $DSV4_IMPL."""
    return load_impl(resolve_impl_name(pytestconfig.getoption("impl")))


@pytest.fixture(scope="session")
def nproc(pytestconfig: pytest.Config) -> int:
    return nproc_of(pytestconfig)

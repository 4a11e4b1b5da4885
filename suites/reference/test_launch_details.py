"""Launch details a cluster run depends on: allocation time, pinned test tools, the compat layer's imports.

* the Slurm allocation outlasts the 32-rank test's own timeout (else Slurm kills it before it can report);
* the tox ``gpu`` env installs its test tools from pinned requirement files only;
* ``impl``'s compat layer installs without ``megatron.training`` (source-built containers may lack it);
* a Transformer Engine that is installed but does not import is reported as such, with its cause.

(Full-size launches run qualify without the transformers oracle: ``suites/reference/test_recipe.py``.)
"""

from __future__ import annotations

import ast
import configparser
import re
import shlex
import sys
import textwrap

import pytest

from fixtures.runner.subproc import REPO_ROOT, pythonpath_first, run

pytestmark = pytest.mark.cpu

SBATCH = REPO_ROOT / "recipes" / "launch_slurm.sbatch"
GPU32 = REPO_ROOT / "suites" / "reference" / "test_gpu32.py"
PINNED = re.compile(r"^[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+$")


def _module_constant(path, name: str) -> int:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return int(eval(compile(ast.Expression(node.value), str(path), "eval")))  # a literal product
    raise AssertionError(f"{path.name} defines no {name}")


def _sbatch_seconds(text: str) -> int:
    m = re.search(r"^#SBATCH\s+--time=(?:(\d+)-)?(\d+):(\d+):(\d+)\s*$", text, re.M)
    assert m, f"{SBATCH.name} has no '#SBATCH --time=[D-]HH:MM:SS' line"
    days, h, mi, s = (int(g or 0) for g in m.groups())
    return ((days * 24 + h) * 60 + mi) * 60 + s


def test_slurm_allocation_outlasts_the_gpu32_timeout():
    allocated = _sbatch_seconds(SBATCH.read_text())
    needed = _module_constant(GPU32, "TIMEOUT_S")
    assert allocated > needed, (
        f"{SBATCH.name} asks {allocated / 3600:.1f} h but suites/reference/test_gpu32.py allows {needed / 3600:.1f} h: Slurm "
        "would kill the job before the test's timeout reports which rank hung"
    )


def _requirement_lines(path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += _requirement_lines(path.parent / line[3:].strip())
        elif line:
            lines.append(line)
    return lines


def test_tox_gpu_env_installs_only_pinned_test_tools():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO_ROOT / "tox.ini")
    commands = tox["testenv:gpu"]["commands_pre"].strip().splitlines()
    installs = [shlex.split(c) for c in commands if "pip install" in c]
    assert installs, "the gpu env installs nothing?"
    unpinned = []
    for words in installs:
        args = words[words.index("install") + 1 :]
        i = 0
        while i < len(args):
            word = args[i]
            if word == "-r":
                path = REPO_ROOT / args[i + 1].replace("{toxinidir}/", "")
                unpinned += [f"{path.name}: {r}" for r in _requirement_lines(path) if not PINNED.match(r)]
                i += 2
            elif word == "-e":
                i += 2  # this project itself
            elif word.startswith("-"):
                i += 1
            else:
                unpinned += [word] if not PINNED.match(word) else []
                i += 1
    assert not unpinned, f"tox gpu env installs unpinned packages: {unpinned}"
    tools = {r.split("==")[0] for words in installs for r in _pins_named(words)}
    assert {"pytest", "pytest-xdist", "pytest-timeout", "hypothesis"} <= tools, f"test tools installed: {tools}"


def _pins_named(words: list[str]) -> list[str]:
    out = []
    for i, w in enumerate(words):
        if w == "-r":
            out += _requirement_lines(REPO_ROOT / words[i + 1].replace("{toxinidir}/", ""))
        elif PINNED.match(w):
            out.append(w)
    return out


def _python(code: str, *, env: dict[str, str] | None = None):
    return run([sys.executable, "-c", textwrap.dedent(code)], timeout=240, env=env)


def test_compat_installs_without_megatron_training(impl):
    result = _python(
        f"""
        import importlib.abc, sys

        class NoMegatronTraining(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "megatron.training" or name.startswith("megatron.training."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NoMegatronTraining())
        import importlib
        api = importlib.import_module({impl.name!r})
        report = api.compat_report()
        assert "megatron.training" not in sys.modules
        print("REPORT", report)
        """
    )
    assert result.returncode == 0 and "REPORT" in result.stdout, (
        f"compat install failed without megatron.training:\n{result.stderr[-3000:]}"
    )


def test_a_present_but_broken_transformer_engine_is_named_with_its_cause(impl, tmp_path):
    te = tmp_path / "transformer_engine"
    te.mkdir()
    (te / "__init__.py").write_text('raise ImportError("libcudart.so.12: cannot open shared object file")\n')
    result = _python(
        f"""
        import importlib
        api = importlib.import_module({impl.name!r})
        try:
            api.compat_report()
        except api.TransformerEngineImportError as exc:
            print("RAISED", exc)
        else:
            print("NOT RAISED")
        """,
        env=pythonpath_first(tmp_path),
    )
    assert "RAISED" in result.stdout, (
        f"a transformer_engine that fails to import was not reported:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    assert "libcudart.so.12" in result.stdout and "transformer_engine" in result.stdout, result.stdout


DEVICE_CHECK = REPO_ROOT / "scripts" / "device_check.sh"
DEVICE_CHECK_STEPS = [
    "versions",
    "cuda-present",
    "qualify-fp32",
    "qualify-bf16",
    "gpu-marked-1gpu",
    "device-suites",
    "layer-memory",
    "load-bench",
]


@pytest.mark.harness  # the device image has no megatron: no Bridge pin changes this script
def test_device_check_reports_every_step_even_when_its_budget_runs_out(tmp_path):
    """A 20 s budget cannot hold the steps: the script must time out / skip them, never stop early, print the
    summary table with every step, and exit non-zero (the full dry run: ``scripts/device_rehearsal.sh``)."""
    assert run(["bash", "-n", str(DEVICE_CHECK)], timeout=30).returncode == 0
    env = {
        "DEVICE_CHECK_DRY": "1",
        "DEVICE_CHECK_BUDGET_S": "20",
        "DEVICE_CHECK_OUT": str(tmp_path),
        "DEVICE_BUNDLE": str(tmp_path / "no-bundle"),  # this environment has megatron: nothing to install
        "PYTHON": sys.executable,
    }
    result = run(["bash", str(DEVICE_CHECK)], timeout=120, env=env)
    table = result.stdout[result.stdout.index("step ") :]
    rows = [line.split()[0] for line in table.splitlines()[1:] if line and not line.startswith("total")]
    assert rows == DEVICE_CHECK_STEPS, f"summary rows {rows}:\n{result.stdout[-3000:]}"
    assert "SKIP (budget spent)" in table or "TIMEOUT" in table, table
    assert result.returncode == 1, f"exit {result.returncode} although steps did not pass:\n{table}"

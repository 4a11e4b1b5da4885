"""Megatron-Bridge imports under the installed transformers, and where it cannot, every command says so in one line.

Megatron-Bridge imports transformers modules at its own import (a model file per family); a transformers that no
longer has one of them makes Bridge unimportable, and with it the native graph, the strict load and ``qualify``. The
latest lane runs where that happens (``xfails/latest-previous.txt``: transformers 5.24); elsewhere the same error is produced by hiding one
transformers module from a fresh interpreter, so the message is proven on every lane.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from fixtures.runner.subproc import run

pytestmark = pytest.mark.cpu

#: a transformers module megatron-bridge 0.6.2 imports at its own import (transformers 5.24 removed it, 5.25 has it)
HIDDEN = "transformers.modeling_attn_mask_utils"

_HIDE_AND_PREPARE = f"""
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {HIDDEN!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
import {{impl}}
try:
    {{impl}}.compat_report()
except {{impl}}.BridgeImportError as exc:
    print("TYPED", exc)
else:
    print("IMPORTS WITHOUT IT")
"""


def _bridge_imports(impl) -> bool:
    try:
        impl.compat_report()
    except ImportError:
        return False
    return True


def test_megatron_bridge_imports_under_the_installed_transformers(impl):
    impl.compat_report()
    assert importlib.util.find_spec("megatron.bridge") is not None
    import megatron.bridge  # noqa: F401


def test_a_transformers_module_bridge_needs_is_named_with_both_versions(impl):
    if not _bridge_imports(impl):
        pytest.skip("megatron-bridge does not import here at all; the next test judges the real error")
    result = run([sys.executable, "-c", _HIDE_AND_PREPARE.replace("{impl}", impl.name)], timeout=300)
    from importlib.metadata import version

    bridge = version("megatron-bridge")
    if "IMPORTS WITHOUT IT" in result.stdout and bridge != impl.LANES["main"]["megatron-bridge"]:
        pytest.skip(f"megatron-bridge {bridge} does not import {HIDDEN}; the main lane's Bridge proves the message")
    typed = [line for line in result.stdout.splitlines() if line.startswith("TYPED ")]
    assert typed, f"no {impl.name}.BridgeImportError:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"

    for word in (HIDDEN, f"megatron-bridge {version('megatron-bridge')}", f"transformers {version('transformers')}"):
        assert word in typed[0], f"{word!r} missing from: {typed[0]}"


def test_qualify_on_a_transformers_bridge_cannot_import_under_fails_in_one_line(impl, tmp_path):
    if _bridge_imports(impl):
        pytest.skip("megatron-bridge imports under this transformers (the latest lane runs this test)")
    result = run([sys.executable, "-m", f"{impl.name}.cli", "qualify", "--out", str(tmp_path / "q")], timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "BridgeImportError" in errors[0] and "does not import under" in errors[0], out[-3000:]

"""``verify-adapter``'s checks through the public ``verify_adapter``: an exported adapter against its base passes, and
each spoilt adapter or base is reported with the tensor or file that is wrong. The same cases run through the command
line after a full ``qualify`` in ``test_cli``; here a tiny base and an exported adapter suffice, so they are fast."""

from __future__ import annotations

import shutil

import pytest

from fixtures.data.adapter_states import export_fingerprinted_adapter
from fixtures.data.adapter_tamper import TAMPER, UNCERTIFY
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PRESET, R, ALPHA = "tiny-mixed", 4, 8.0


@pytest.fixture(scope="module")
def exported(impl, tmp_path_factory):
    """A tiny official-layout base and an adapter on the five main targets exported against it, fingerprinted."""
    root = tmp_path_factory.mktemp("verify")
    base = write_checkpoint(PRESET, root / "base", seed=2)
    return base, export_fingerprinted_adapter(impl, base, root / "adapter", get_preset(PRESET), r=R, alpha=ALPHA)


def _edited_copies(exported, tmp_path, edit):
    """Copies of the exported base and adapter under ``tmp_path``, then ``edit(adapter, base)`` applied to them."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(exported[0], base)
    shutil.copytree(exported[1], adapter)
    edit(adapter, base)
    return base, adapter


def test_an_exported_adapter_passes_against_its_base(impl, exported):
    base, adapter = exported
    result = impl.verify_adapter(base, adapter)
    assert result.ok and not result.problems, f"problems: {result.problems}"


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_each_spoilt_adapter_or_base_is_reported_by_name(impl, exported, tmp_path, case):
    tamper, expected = TAMPER[case]
    base, adapter = _edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter)
    problems = "\n".join(result.problems)
    assert not result.ok, f"{case}: verify_adapter passed a spoilt adapter"
    assert expected in problems, f"{case}: the problem list does not name {expected!r}:\n{problems}"


@pytest.mark.parametrize("case", sorted(UNCERTIFY))
def test_a_sound_adapter_without_provenance_is_uncertified_not_wrong(impl, exported, tmp_path, case):
    """Without ``.complete`` an adapter cannot prove its completeness: it passes as uncertified, and fails only when
    certification is required, naming what is missing."""
    edit, expected = UNCERTIFY[case]
    base, adapter = _edited_copies(exported, tmp_path, edit)
    result = impl.verify_adapter(base, adapter)
    assert result.ok, f"{case}: an otherwise sound adapter failed: {result.problems}"
    assert result.uncertified and expected in result.uncertified, f"{case}: provenance says {result.uncertified!r}"
    strict = impl.verify_adapter(base, adapter, require_certified=True)
    assert not strict.ok and any(expected in p for p in strict.problems), strict.problems


def test_an_exported_adapter_is_certified(impl, exported):
    result = impl.verify_adapter(*exported, require_certified=True)
    assert result.ok and result.uncertified is None, (result.problems, result.checks[-1])


def test_verify_adapter_reads_without_importing_torch(impl, exported):
    """The checks read bytes, shapes and dtypes: importing torch would cost the command about a second and
    ~500 MB before it reads anything (``pytest -m bench -s suites/reference/test_bench_full_size_base.py``)."""
    from fixtures.runner.subproc import cli_imports

    base, adapter = exported
    status, torch_imported, out = cli_imports(
        impl.name, ["verify-adapter", "--base", base, "--adapter", adapter], "torch"
    )
    assert status == 0 and not torch_imported, out[-4000:]


#: the spoilt adapters the conformance judge sees from the files alone (the others are about the base or provenance)
JUDGED = ("indexer-wrapping", "wrong-shape-lora_B", "nan", "missing-half")


def test_the_conformance_judge_passes_an_exported_adapter(impl, exported):
    """``--judge`` adds the conformance suites' own verdict (``dsv4_conformance.judge``) as a row of its own."""
    result = impl.verify_adapter(*exported, judge=True)
    row = next((c for c in result.checks if c.name == "conformance"), None)
    assert row is not None and row.passed, f"the judge's row: {row}; problems: {result.problems}"


@pytest.mark.parametrize("case", JUDGED)
def test_the_conformance_judge_fails_a_spoilt_adapter(impl, exported, tmp_path, case):
    tamper, _ = TAMPER[case]
    base, adapter = _edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter, judge=True)
    row = next((c for c in result.checks if c.name == "conformance"), None)
    assert row is not None and row.passed is False, f"{case}: the judge's row passed a spoilt adapter: {row}"

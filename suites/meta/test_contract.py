"""The contract in docs/reference_api.md is what the suites read, and the reference implementation provides it.

The list is generated from the suites' source (``fixtures/contract/suite_contract.py``), never from an implementation; a suite
that starts reading a new name makes the document stale until ``scripts/contract.py --write`` is run."""

from __future__ import annotations

import pytest

from fixtures.contract.suite_contract import CONTRACT_DOC, contract_names, optional_names, render_contract

pytestmark = pytest.mark.cpu


def test_the_documented_contract_is_the_generated_one():
    CONTRACT_DOC.assert_current(
        render_contract(contract_names(), optional_names()), what="contract", source="what the suites read"
    )


def test_the_reference_implementation_provides_every_name_of_the_contract(impl):
    if impl.name != "impl":
        pytest.skip("the contract is the suites'; another implementation's gaps are its xfails")
    optional = optional_names()
    missing = [name for name in contract_names() if name not in optional and name not in impl.module.__all__]
    assert not missing, f"the reference implementation does not provide: {missing}"


def test_a_name_a_suite_reads_joins_the_contract(tmp_path):
    (tmp_path / "suites").mkdir()
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "suites" / "test_x.py").write_text(
        "def test_a(impl):\n    impl.export_adapter()\n    impl.name\n    impl._private\n"
    )
    (tmp_path / "fixtures" / "ranks.py").write_text(
        "def rank(name):\n    api = load_impl(name)\n    api.NewError\n    if api.provides('extra'):\n        api.extra()\n"
    )
    assert contract_names(tmp_path) == {
        "NewError": ["fixtures/ranks.py"],
        "export_adapter": ["suites/test_x.py"],
        "extra": ["fixtures/ranks.py"],
    }
    assert optional_names(tmp_path) == {"extra"}


def test_every_public_name_of_the_reference_resolves(impl):
    """The package's ``__all__`` is read from its modules' sources without importing them; each name it lists
    must then be what importing that module provides."""
    if impl.name != "impl":
        pytest.skip("how the reference builds its public API")
    unresolved = []
    for name in impl.module.__all__:
        try:
            getattr(impl.module, name)
        except AttributeError as exc:
            unresolved.append(f"{name}: {exc}")
    assert not unresolved, "public names that do not resolve:\n  " + "\n  ".join(unresolved)


def test_the_driver_page_is_generated_from_the_driver_contract():
    from fixtures.contract.driver_page import DRIVER_DOC, render_driver_page

    DRIVER_DOC.assert_current(
        render_driver_page(),
        what="generated section",
        source="dsv4_conformance.driver and the suites' needs markers",
    )

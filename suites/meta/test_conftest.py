"""The harness's own contract: markers, options and the impl fixture."""

import re
import sys
import types

import pytest
from hypothesis import settings

pytestmark = pytest.mark.cpu


def test_hypothesis_profile_is_loaded(pytestconfig):
    assert settings.default.max_examples >= 1
    assert pytestconfig.dsv4_profile in {"dev", "ci", "report", "thorough"}


def test_missing_entry_point_raises_impl_missing(impl):
    from fixtures.runner.impl_loader import ImplMissing

    with pytest.raises(ImplMissing, match="no_such_entry_point"):
        impl.no_such_entry_point()
    with pytest.raises(ImplMissing):  # what a test expecting an error of the implementation writes never catches it
        try:
            impl.no_such_entry_point()
        except Exception:
            pass


def test_loadgroup_keeps_an_xdist_group_on_one_worker(tmp_path):
    """Shared multi-rank runs and the qualify fixture rely on ``--dist loadgroup``. pytest 9.2 keeps node ids in
    ``_id`` while pytest-xdist 3.8 tags groups through ``_nodeid``, so there the grouping silently did nothing
    (requirements/base.txt pins pytest 9.1.1); this run of a generated file catches such a pairing."""
    from fixtures.runner.subproc import run

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(
        "import os, pathlib, pytest\n"
        "@pytest.mark.xdist_group('together')\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_member(i):\n"
        "    (pathlib.Path(__file__).parent / f'ran-{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
    )
    argv = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
    result = run([*argv, "test_grouped.py"], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = {p.name: p.read_text() for p in tmp_path.glob("ran-*")}
    assert len(workers) == 8, f"not every grouped test ran: {sorted(workers)}"
    assert len(set(workers.values())) == 1, f"one xdist_group was spread over workers: {workers}"


# --- the strict xfails file and the marker rule, on a generated suite run under this repository's conftest ---

_GENERATED_TESTS = """
import pytest

pytestmark = pytest.mark.cpu


def test_fails_as_listed():
    raise ModuleNotFoundError("the gap this line records")


def test_fails_with_the_implementations_error():
    raise FakeImplError("a typed error of the implementation under test")


def test_fails_with_another_exception():
    raise KeyError("not the listed gap")


def test_passes_although_listed():
    pass


def test_not_listed():
    pass
""".replace("FakeImplError", "__import__('fake_impl').FakeImplError")


def _run_under_our_conftest(tmp_path, test_file: str, source: str, *args: str) -> tuple[int, str]:
    """Run ``source`` as ``test_file`` under a copy of the repository's conftest (``--impl fake_impl``, a module
    holding one exception class); return pytest's exit code and output."""
    import shutil

    from fixtures.runner.subproc import REPO_ROOT, run

    shutil.copy(REPO_ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    (tmp_path / "fake_impl.py").write_text("__all__ = ['FakeImplError']\nclass FakeImplError(Exception):\n    pass\n")
    (tmp_path / test_file).write_text(source)
    argv = [sys.executable, "-m", "pytest", "-n", "0", "-rA", "--impl", "fake_impl", *args, test_file]
    result = run(argv, timeout=120, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    return result.returncode, result.stdout + result.stderr


def _run_generated_suite(tmp_path, xfails: str | None) -> tuple[int, str]:
    """The generated tests, with ``xfails`` (if given) as the --xfails-file."""
    args = []
    if xfails is not None:
        (tmp_path / "xfails.txt").write_text(xfails)
        args = ["--xfails-file", "xfails.txt"]
    return _run_under_our_conftest(tmp_path, "test_generated.py", _GENERATED_TESTS, *args)


def _outcomes(output: str) -> dict[str, str]:
    """test name -> PASSED / FAILED / XFAIL / XPASS from pytest's -rA summary."""
    from fixtures.runner.subproc import pytest_outcomes

    return {node.split("::")[1]: word for node, word in pytest_outcomes(output).items()}


_XFAILS = """# reason: a recorded gap
test_generated.py::test_fails_as_listed ModuleNotFoundError
test_generated.py::test_fails_with_the_implementations_error impl.FakeImplError
test_generated.py::test_fails_with_another_exception ModuleNotFoundError
test_generated.py::test_passes_although_listed ImportError
"""


#: each generated test, its outcome with ``_XFAILS`` as the xfails file, and its outcome without one
_OUTCOMES = [
    ("test_fails_as_listed", "XFAIL", "FAILED"),
    ("test_fails_with_the_implementations_error", "XFAIL", "FAILED"),
    ("test_fails_with_another_exception", "FAILED", "FAILED"),
    ("test_passes_although_listed", "FAILED", "PASSED"),
    ("test_not_listed", "PASSED", "PASSED"),
]


def _run_expecting_outcomes(tmp_path, xfails: str | None) -> str:
    """Run the generated suite with ``xfails`` as the xfails file (None: without one): every test must end as
    ``_OUTCOMES`` says for that run, and the run must fail (exit 1). Returns pytest's output."""
    rc, out = _run_generated_suite(tmp_path, xfails)
    expected = {test: with_file if xfails is not None else without for test, with_file, without in _OUTCOMES}
    assert _outcomes(out) == expected, out[-4000:]
    assert rc == 1, out[-4000:]
    return out


def test_xfails_file_fails_a_listed_test_that_passes_or_raises_another_exception(tmp_path):
    out = _run_expecting_outcomes(tmp_path, _XFAILS)
    assert "[XPASS(strict)]" in out, out[-4000:]


def test_without_an_xfails_file_the_generated_tests_fail_only_where_they_raise(tmp_path):
    """The control run: the outcomes above come from the xfails file, not from the generated tests."""
    _run_expecting_outcomes(tmp_path, None)


def test_an_xfails_line_matching_no_collected_test_is_a_usage_error(tmp_path):
    rc, out = _run_generated_suite(tmp_path, _XFAILS + "test_generated.py::test_renamed_since ModuleNotFoundError\n")
    assert rc == pytest.ExitCode.USAGE_ERROR, f"exit {rc}\n{out[-4000:]}"
    assert "entries that match no collected test:\n  test_generated.py::test_renamed_since" in out, out[-4000:]


BAD_LINES = {
    "no exception": ("test_x.py::test_y", "names no expected exception"),
    "an unknown builtin": ("test_x.py::test_y NoSuchError", "cannot find the exception 'NoSuchError'"),
    "a missing module": ("test_x.py::test_y no_such_module.Error", "cannot find the exception"),
    "a name the implementation lacks": ("test_x.py::test_y impl.NoSuchError", "cannot find the exception"),
    "not an exception": ("test_x.py::test_y len", "'len' is not an exception type"),
    "an implementation name that is no exception": ("test_x.py::test_y impl.not_a_type", "is not an exception type"),
}


class _ConfigWithImpl:
    """Just enough of ``pytest.Config`` for the xfails reader: ``--impl`` names the fake implementation."""

    def getoption(self, name: str):
        assert name == "impl", name
        return "fake_impl"


@pytest.mark.parametrize(("line", "message"), BAD_LINES.values(), ids=list(BAD_LINES))
def test_a_malformed_xfails_line_is_a_usage_error_naming_the_line(tmp_path, monkeypatch, line, message):
    import conftest

    fake_impl = types.ModuleType("fake_impl")
    fake_impl.FakeImplError, fake_impl.not_a_type = type("FakeImplError", (Exception,), {}), 3
    monkeypatch.setitem(sys.modules, "fake_impl", fake_impl)
    path = tmp_path / "xfails.txt"
    path.write_text(f"# reason: a gap\ntest_x.py::test_ok impl.FakeImplError\n{line}\n")
    with pytest.raises(pytest.UsageError, match=re.escape(message)) as err:
        conftest._read_xfails_file(_ConfigWithImpl(), str(path))
    assert f"{path}:3" in str(err.value), err.value


def test_a_test_without_a_required_marker_is_a_usage_error(tmp_path):
    source = "import pytest\n\n@pytest.mark.slow\ndef test_without_a_kind():\n    pass\n"
    rc, out = _run_under_our_conftest(tmp_path, "test_unmarked.py", source)
    assert rc == pytest.ExitCode.USAGE_ERROR, f"exit {rc}\n{out[-4000:]}"
    assert "tests without one of the markers cpu, gpu, gpu32, bench:\n  test_unmarked.py::test_without_a_kind" in out, (
        out
    )

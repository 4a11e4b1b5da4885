"""The harness's own contract: markers, options and the impl fixture."""

import pytest
from hypothesis import settings

pytestmark = pytest.mark.cpu


def test_hypothesis_profile_is_loaded(pytestconfig):
    assert settings.default.max_examples >= 1
    assert pytestconfig.dsv4_profile in {"dev", "ci", "thorough"}


def test_missing_entry_point_raises_impl_missing(impl):
    from fixtures.impl_loader import ImplMissing

    with pytest.raises(ImplMissing, match="no_such_entry_point"):
        impl.no_such_entry_point()


def test_loadgroup_keeps_an_xdist_group_on_one_worker(tmp_path):
    """Shared multi-rank runs and the qualify fixture rely on ``--dist loadgroup``. pytest 9.2 keeps node ids in
    ``_id`` while pytest-xdist 3.8 tags groups through ``_nodeid``, so there the grouping silently did nothing
    (requirements/base.txt pins pytest 9.1.1); this run of a generated file catches such a pairing."""
    import sys

    from fixtures.subproc import run

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

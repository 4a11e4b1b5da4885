"""Everything an export publishes is readable like any file the user writes: each file's mode is what a plain
``open(path, "w")`` gives under the process umask (0644 under umask 022), each directory's what ``mkdir`` gives,
in every dialect, so a serving process running as another user can read the adapter."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fixtures.data.adapter_states import attention_shapes, make_native_adapter

pytestmark = pytest.mark.cpu

LAYERS, R = 2, 4
SHAPES = attention_shapes(64, 32, 4, 16, 2, 16)
#: the issue's figures, beside the oracle (the mode a plain open/mkdir gives under the same umask)
PLAIN_FILE_MODE = {0o022: 0o644, 0o077: 0o600}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _plain_modes(scratch: Path) -> tuple[int, int]:
    """(file, directory) modes a plain open() / mkdir() give under the current umask."""
    scratch.mkdir()
    with open(scratch / "plain", "w") as f:
        f.write("x")
    return _mode(scratch / "plain"), _mode(scratch)


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", sorted(PLAIN_FILE_MODE), indirect=True, ids=lambda m: f"umask{m:03o}")
@pytest.mark.parametrize("dialect", ["transformers", "official", "sglang"])
def test_every_published_file_follows_the_umask(impl, tmp_path, umask, dialect):
    assert dialect in impl.DIALECTS, f"dialect {dialect} is not offered any more: {sorted(impl.DIALECTS)}"
    want_file, want_dir = _plain_modes(tmp_path / "plain")
    assert want_file == PLAIN_FILE_MODE[umask], f"the platform's open() gives {want_file:o} under umask {umask:03o}"
    state = impl.AdapterState(make_native_adapter(SHAPES, LAYERS, R, seed=3), r=R, alpha=8.0)
    out = impl.export_adapter(state, tmp_path / "adapter", dialect=dialect)
    published = sorted(out.iterdir())
    names = {p.name for p in published}
    assert {"adapter_model.safetensors", "adapter_config.json", ".complete"} <= names, names
    wrong = [f"{p.name} {_mode(p):o}" for p in published if p.is_file() and _mode(p) != want_file]
    assert not wrong, f"{dialect}, umask {umask:03o}: files not {want_file:o} like a plain open(): {wrong}"
    assert _mode(out) == want_dir, f"{dialect}: {out} is {_mode(out):o}, mkdir gives {want_dir:o}"


@pytest.mark.parametrize("umask", [0o022], indirect=True, ids=lambda m: f"umask{m:03o}")
def test_a_re_export_over_an_earlier_one_follows_the_umask_too(impl, tmp_path, umask):
    state = impl.AdapterState(make_native_adapter(SHAPES, LAYERS, R, seed=3), r=R, alpha=8.0)
    out = tmp_path / "adapter"
    impl.export_adapter(state, out)
    (out / "adapter_model.safetensors").chmod(0o600)
    impl.export_adapter(state, out)
    assert _mode(out / "adapter_model.safetensors") == 0o644

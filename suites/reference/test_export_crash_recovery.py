"""An export that dies between publishing and its commit point is rolled back: a failed phase restores the earlier
export on the spot, a process killed there leaves a state ``recover_export_dir`` undoes, and the next export
rolls it back by itself before it publishes."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from fixtures.data.adapter_states import attention_shapes, make_native_adapter, snapshot_tree

pytestmark = pytest.mark.cpu

R = 4
SHAPES = attention_shapes(hidden=64, q_lora=48, heads=4, head_dim=32, o_groups=2, o_lora=16)
CRASH_EXIT = 37  # what the killed exporter exits with, told apart from any other death


def _state(impl, alpha: float):
    return impl.AdapterState(make_native_adapter(SHAPES, 2, R), r=R, alpha=alpha)


def _phases_failing_at(impl, name: str, fail):
    def wrapped(ctx) -> None:
        fail()

    return tuple((n, wrapped if n == name else run) for n, run in impl.EXPORT_PHASES)


def _raise() -> None:
    raise OSError("disk full while writing .complete")


def test_a_phase_failing_after_publish_restores_the_earlier_export(impl, tmp_path):
    out = tmp_path / "adapter"
    impl.export_adapter(_state(impl, 8.0), out)
    before = snapshot_tree(out)
    with pytest.raises(impl.CollectiveExportError, match="phase marker"):
        impl.export_adapter(_state(impl, 9.0), out, phases=_phases_failing_at(impl, "marker", _raise))
    assert snapshot_tree(out) == before, "a failure after publish did not bring the earlier export back"


def _export_and_die(impl, out) -> None:
    impl.export_adapter(_state(impl, 9.0), out, phases=_phases_failing_at(impl, "marker", lambda: os._exit(CRASH_EXIT)))


def _crash_after_publish(impl, out) -> None:
    child = multiprocessing.get_context("fork").Process(target=_export_and_die, args=(impl, out))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == CRASH_EXIT, f"the exporter did not die in its marker phase (exit {child.exitcode})"


def test_recover_export_dir_restores_the_export_a_killed_exporter_replaced(impl, tmp_path):
    out = tmp_path / "adapter"
    impl.export_adapter(_state(impl, 8.0), out)
    before = snapshot_tree(out)
    _crash_after_publish(impl, out)
    assert snapshot_tree(out) != before, "the killed exporter changed nothing: the test proves nothing"
    said = impl.recover_export_dir(out)
    assert snapshot_tree(out) == before, "recovery did not restore the export the killed one replaced"
    assert "restored the previous destination" in said, f"recovery restored the export but says {said!r}"
    again = impl.recover_export_dir(out)
    assert again == "nothing to recover", f"a second recovery of a settled destination says {again!r}"


def test_the_next_export_rolls_back_a_killed_one_before_publishing(impl, tmp_path):
    out = tmp_path / "adapter"
    impl.export_adapter(_state(impl, 8.0), out)
    _crash_after_publish(impl, out)
    impl.export_adapter(_state(impl, 10.0), out)
    written = impl.validate_adapter_dir(out)["config"]["lora_alpha"]
    assert written == 10.0, f"the destination holds lora_alpha={written}, not the last export's 10.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "the killed export left files beside it"

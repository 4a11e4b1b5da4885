"""An exported adapter imports back: a fresh model that imports it computes the trained model's logits bit for bit and
exports the same tensors again, at a layout that shards the adapter (what resuming from, or continuing, a published
adapter relies on)."""

from __future__ import annotations

import pytest

from dsv4_conformance.driver import Layout, LoraSpec
from dsv4_conformance.judge.artifacts import judge_adapter_dir
from fixtures.conformance.programs import DriverCase, import_round_trip

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.multirank,
    pytest.mark.needs("build", "train_step", "logits", "export", "import_adapter"),
]


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2)], ids=str)
def test_an_imported_export_is_the_trained_adapter(drive, driver_name, conformance_base, tmp_path, layout):
    import torch
    from safetensors.torch import load_file

    case = DriverCase(driver_name, str(conformance_base), layout, LoraSpec(), str(tmp_path))
    (payload, *_) = drive(import_round_trip, case, timeout_s=300)
    for export in ("trained", "again"):
        unreadable = [
            p for p in judge_adapter_dir(tmp_path / export, conformance_base) if p.check in ("files", "format")
        ]
        assert not unreadable, f"{layout}: the {export} export is not a readable adapter: {unreadable[0]}"
    trained_logits, imported_logits = torch.from_numpy(payload["trained"]), torch.from_numpy(payload["imported"])
    assert torch.equal(trained_logits, imported_logits), (
        f"{layout}: the imported model's logits differ from the trained one's by "
        f"{(trained_logits - imported_logits).abs().max():.3e}"
    )
    for export in ("trained", "again"):
        unreadable = [
            p for p in judge_adapter_dir(tmp_path / export, conformance_base) if p.check in ("files", "format")
        ]
        assert not unreadable, f"{layout}: the {export} export is not a readable adapter: {unreadable[0]}"
    trained = load_file(str(tmp_path / "trained" / "adapter_model.safetensors"))
    again = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert set(trained) == set(again), f"{layout}: re-exported names differ: {sorted(set(trained) ^ set(again))[:4]}"
    differ = sorted(k for k in trained if not torch.equal(trained[k], again[k]))
    assert not differ, f"{layout}: {len(differ)} tensors changed through import and export, e.g. {differ[0]}"

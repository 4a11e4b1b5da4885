"""Strict load of official checkpoints into the native model: all or nothing, every offender named."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint("tiny-mixed", tmp_path_factory.mktemp("ckpt"), seed=3)


def _model(impl):
    return impl.DeepseekV4NativeModel(impl.V4Config.from_hf(get_preset("tiny-mixed")), include_mtp=True)


def test_load_then_export_is_bit_exact(impl, ckpt):
    model = _model(impl)
    report = impl.load_official_checkpoint([model], ckpt)
    ref = load_file(str(ckpt / "model.safetensors"))
    assert report.totals["loaded"] == len(ref) and report.totals["unmapped"] == 0, report
    out = impl.export_official_state([model])
    assert set(out) == set(ref), f"exported extra {set(out) - set(ref)}, lost {set(ref) - set(out)}"
    for name, t in ref.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), f"{name} changed in the round trip"


def _edited(ckpt, tmp_path, edit):
    tensors = load_file(str(ckpt / "model.safetensors"))
    files = edit(tensors) or {"model.safetensors": tensors}
    for fname, ts in files.items():
        save_file(ts, str(tmp_path / fname))
    return tmp_path


def _beyond_the_model(t):
    """Names the mapping table knows, at an index this model lacks: a deeper model's layer, a larger MoE's expert."""
    t["layers.99.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"].clone()
    t["layers.0.ffn.experts.999.w2.weight"] = t["layers.0.ffn.experts.0.w2.weight"].clone()


# kind -> (edit, what the error must say: "<kind> <name>" for a kind of its own, else just the name)
CASES = {
    "unmapped": (lambda t: t.update({"layers.0.attn.wq_c.weight": torch.zeros(2, 2)}), ["layers.0.attn.wq_c.weight"]),
    "index-outside-the-model": (
        _beyond_the_model,
        ["layers.99.attn.wq_a.weight", "layers.0.ffn.experts.999.w2.weight"],
    ),
    "missing": (
        lambda t: [t.pop("layers.1.attn.wo_b.weight"), t.pop("norm.weight")],
        ["missing layers.1.attn.wo_b.weight", "missing norm.weight"],
    ),
    "mis-shaped": (
        lambda t: t.update({"layers.0.attn.wq_a.weight": torch.zeros(3, 5)}),
        ["mis-shaped layers.0.attn.wq_a.weight"],
    ),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_bad_checkpoint_raises_one_error_naming_all_offenders(impl, ckpt, tmp_path, kind):
    edit, expected = CASES[kind]
    bad = _edited(ckpt, tmp_path, lambda t: edit(t) and None)
    with pytest.raises(impl.CheckpointMappingError) as err:
        impl.load_official_checkpoint([_model(impl)], bad)
    for phrase in expected:
        assert phrase in str(err.value), f"{kind}: the error does not name {phrase!r}:\n{err.value}"


def test_duplicated_tensor_across_shards_is_rejected(impl, ckpt, tmp_path):
    def split(t):
        return {"a.safetensors": t, "b.safetensors": {"embed.weight": t["embed.weight"].clone()}}

    bad = _edited(ckpt, tmp_path, split)
    with pytest.raises(impl.CheckpointMappingError, match="duplicated checkpoint tensor embed.weight"):
        impl.load_official_checkpoint([_model(impl)], bad)


def test_a_tensor_one_row_short_is_refused_before_any_weight_is_written(impl, ckpt, tmp_path):
    """All or nothing: a tensor whose trailing dims fit but whose first dim is short (only the vocabulary may be
    padded) is named as mis-shaped, and the model is left exactly as it was."""
    name = "layers.0.attn.wq_a.weight"
    bad = _edited(ckpt, tmp_path, lambda t: t.update({name: t[name][:-1].clone()}))
    model = _model(impl)
    before = {n: t.clone() for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    with pytest.raises(impl.CheckpointMappingError, match=f"mis-shaped {name}"):
        impl.load_official_checkpoint([model], bad)
    after = model.state_dict()
    written = [n for n, t in before.items() if not torch.equal(after[n], t)]
    assert not written, f"a refused checkpoint wrote {len(written)} tensors, e.g. {written[:3]}"


def test_the_refusal_carries_a_report_naming_each_missing_tensor_and_printing_its_totals(impl, ckpt, tmp_path):
    """A caller that catches the refusal reads the offenders by kind from its report (the checkpoint names, not the
    message's words), and the report prints as its totals."""
    gone = ["layers.1.attn.wo_b.weight", "norm.weight"]
    bad = _edited(ckpt, tmp_path, lambda t: [t.pop(name) for name in gone] and None)
    with pytest.raises(impl.CheckpointMappingError) as err:
        impl.load_official_checkpoint([_model(impl)], bad)
    report = err.value.report
    assert sorted(report.missing) == gone, f"the report's missing tensors are {report.missing}, not {gone}"
    assert "missing=2" in str(report), f"the report prints {str(report)!r}, without its count of missing tensors"

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


@pytest.mark.parametrize("rows", ["short", "long"])
@pytest.mark.parametrize("name", ["layers.0.attn.wq_a.weight", "embed.weight", "head.weight"])
def test_a_tensor_one_row_short_or_long_is_refused_before_any_weight_is_written(impl, ckpt, tmp_path, name, rows):
    """All or nothing: a tensor whose trailing dims fit but whose first dim is one short or one long (the vocabulary
    too: the model is built from config.json's vocab_size, never padded) is named as mis-shaped, and the model is
    left exactly as it was."""

    def edit(t):
        t[name] = t[name][:-1].clone() if rows == "short" else torch.cat([t[name], t[name][:1]])

    bad = _edited(ckpt, tmp_path, edit)
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


def test_a_tensor_at_an_index_the_model_lacks_is_named_with_the_native_tensor_it_would_fill(impl, ckpt, tmp_path):
    """A tensor the mapping knows, at a layer or expert this model lacks, is refused as 'no native tensor ... in this
    model' naming the native tensor at that index; one no row knows says so instead."""
    bad = _edited(ckpt, tmp_path, lambda t: [_beyond_the_model(t), CASES["unmapped"][0](t)] and None)
    with pytest.raises(impl.CheckpointMappingError) as err:
        impl.load_official_checkpoint([_model(impl)], bad)
    lines = {line.split()[3]: line for line in str(err.value).splitlines() if "unmapped checkpoint tensor" in line}
    for name, index in (("layers.99.attn.wq_a.weight", "99"), ("layers.0.ffn.experts.999.w2.weight", "999")):
        reason = lines[name].partition(": ")[2]
        assert reason.startswith("no native tensor") and f".{index}." in reason and reason.endswith("in this model"), (
            f"{name}: the refusal says {reason!r}, not which native tensor at index {index} the model lacks"
        )
    assert "no row in" in lines["layers.0.attn.wq_c.weight"], lines


def test_an_exported_state_is_a_copy_that_training_on_does_not_change(impl, ckpt):
    """export_official_state hands out tensors of their own: a step that updates the model in place afterwards
    leaves what was exported as the checkpoint it loaded."""
    model = _model(impl)
    impl.load_official_checkpoint([model], ckpt)
    out = impl.export_official_state([model])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ref = load_file(str(ckpt / "model.safetensors"))
    changed = [n for n, t in ref.items() if not torch.equal(out[n], t)]
    assert not changed, f"{len(changed)} exported tensors follow the live parameters, e.g. {changed[:3]}"


def test_a_model_holding_a_tensor_no_row_maps_is_refused_at_export_naming_it(impl, ckpt):
    """Export never drops a native tensor silently: one the mapping table has no row for is named in the error."""
    model = _model(impl)
    impl.load_official_checkpoint([model], ckpt)
    model.register_parameter("stray_scale", torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(impl.CheckpointMappingError, match=r"1 native tensors have no row .*: stray_scale"):
        impl.export_official_state([model])


@pytest.mark.parametrize("edit", ["missing", "mis-shaped"])
@pytest.mark.parametrize("half", ["layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.experts.1.w1.weight"])
def test_one_bad_half_of_a_gated_pair_is_the_only_offender(impl, ckpt, tmp_path, half, edit):
    """The gate (w1) and up (w3) projections load into one native tensor: when the gate is missing or mis-shaped,
    the refusal names the gate alone, and its intact partner is not called unmapped."""
    change = (lambda t: t.pop(half)) if edit == "missing" else (lambda t: t.update({half: t[half][:, :-1].clone()}))
    bad = _edited(ckpt, tmp_path, lambda t: [change(t)] and None)
    with pytest.raises(impl.CheckpointMappingError) as err:
        impl.load_official_checkpoint([_model(impl)], bad)
    offenders = err.value.offenders
    assert len(offenders) == 1 and offenders[0].startswith(f"{edit} {half}"), (
        f"{edit} {half}: the refusal lists {offenders}, not the one bad half"
    )
    want = tuple(load_file(str(ckpt / "model.safetensors"))[half].shape)
    assert f"expected shape {want}" in offenders[0], f"{half}: the refusal does not expect {want}: {offenders[0]}"


def test_a_model_holding_a_tensor_no_row_maps_is_refused_at_load_naming_it_alone(impl, ckpt):
    """A native tensor the mapping table cannot fill is the refusal's one offender; every other tensor still plans."""
    model = _model(impl)
    model.register_parameter("stray_scale", torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(impl.CheckpointMappingError) as err:
        impl.load_official_checkpoint([model], ckpt)
    offenders = err.value.offenders
    assert len(offenders) == 1 and offenders[0].startswith("unmapped native tensor stray_scale (3,)"), offenders

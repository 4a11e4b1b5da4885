"""Fail closed on an empty conversion, through a real native model: PP=2 ranks build the tiny model (the layout
regenerated from a saved run whose run_config.yaml lost it), apply LoRA to both stages, one, or none, then gather
and export. The export refuses (the same collective error on every rank, the destination untouched) exactly when
no rank holds an adapter, and succeeds when some stage does, including a stage other than the writer's."""

from pathlib import Path

import pytest
from safetensors import safe_open

from fixtures.ranks.empty_conversion_rank_fns import EmptyConversionCase, rank_empty_conversion
from fixtures.runner.multirank import impl_preload, run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.slow]

PRESET = "tiny-mixed"  # 4 layers, 2 hash-routed: the regenerated PP=2 layout is layers 0-1 | layers 2-3
OLD = "an earlier adapter that must survive a refused export"


def _run(impl, tmp_path: Path, targets: tuple[str, ...]) -> tuple[list[dict], Path]:
    run_dir = tmp_path / "run"
    (run_dir / "iter_0000010").mkdir(parents=True)
    (run_dir / "iter_0000010" / "run_config.yaml").write_text(
        "model:\n  pipeline_model_parallel_layout:\n"
        "    _target_: megatron.core.transformer.pipeline_parallel_layer_layout.PipelineParallelLayerLayout\n"
    )
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "README").write_text(OLD)
    case = EmptyConversionCase(impl.name, PRESET, str(run_dir), str(out), targets=targets)
    results = run_ranks(rank_empty_conversion, case, nproc=2, timeout_s=240, preload=impl_preload(impl.name))
    return [r.payload for r in results], out


def _exported_names(out: Path) -> list[str]:
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as fh:
        return sorted(fh.keys())


def test_a_model_without_adapters_fails_closed_on_every_rank_and_publishes_nothing(impl, tmp_path):
    payloads, out = _run(impl, tmp_path, targets=())
    assert [p["layout"] for p in payloads][0] == [["embedding", "decoder", "decoder"], ["decoder", "decoder", "loss"]]
    assert all(p["local_adapters"] == [] for p in payloads), [p["local_adapters"] for p in payloads]
    assert payloads[0]["gathered"] == [], payloads[0]["gathered"]
    errors = [p.get("error") for p in payloads]
    assert all(e and "EmptyAdapterError" in e for e in errors), errors
    assert errors[0] == errors[1], f"ranks disagree on the failure: {errors}"
    assert sorted(p.name for p in out.iterdir()) == ["README"] and (out / "README").read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "run"], "staging / rollback debris left behind"


@pytest.mark.parametrize(
    ("targets", "stage_with_adapters", "layers"),
    [
        (("*.layers.0.self_attention.wq_b",), 0, [0]),
        (("*.layers.3.self_attention.wq_b", "*.layers.2.self_attention.wkv"), 1, [2, 3]),
    ],
    ids=["only-the-writers-stage", "only-the-other-stage"],
)
def test_one_stage_holding_adapters_is_enough_to_export(impl, tmp_path, targets, stage_with_adapters, layers):
    payloads, out = _run(impl, tmp_path, targets=targets)
    holding = [rank for rank, p in enumerate(payloads) if p["local_adapters"]]
    assert holding == [stage_with_adapters], f"ranks holding adapters: {holding}"
    assert all(p.get("exported") for p in payloads), [p.get("error") for p in payloads]
    names = _exported_names(out)
    assert sorted({int(n.split(".")[3]) for n in names}) == layers, names
    assert len(names) == 2 * len(targets), names
    assert sorted(p.name for p in out.iterdir()) == [".complete", "adapter_config.json", "adapter_model.safetensors"]

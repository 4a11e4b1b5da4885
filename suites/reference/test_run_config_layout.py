"""#4306: exporting a saved run whose ``run_config.yaml`` lost the pipeline layout (an object stub instead of a
list) regenerates the concrete layout, and the result equals Megatron-Bridge's own DeepSeek-V4 layout functions
(``DeepSeekV4Bridge.generate_pipeline_layout`` and ``set_deepseek_v4_pipeline_model_parallel_layout``) for Flash and
Pro at PP 2/4/8 under every pin that ships them. The expected layouts come from those functions, never from ours."""

import importlib
import importlib.metadata
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from tiny_models.presets import flash_config, pro_config

pytestmark = pytest.mark.cpu

PIN = importlib.metadata.version("megatron-bridge")
UPSTREAM_MODULE = "megatron.bridge.models.deepseek.deepseek_v4_bridge"
CONFIGS = {"flash": flash_config, "pro": pro_config}
LAYOUT_CLASS = "megatron.core.transformer.pipeline_parallel_layer_layout.PipelineParallelLayerLayout"

# How a run_config.yaml can hold a layout object it could not serialize (the #4306 report), and nothing at all.
STUBS = {
    "target-stub": f"model:\n  pipeline_model_parallel_layout:\n    _target_: {LAYOUT_CLASS}\n",
    "python-object-tag": f"model:\n  pipeline_model_parallel_layout: !!python/object:{LAYOUT_CLASS} {{}}\n",
    "repr-string": f"model:\n  pipeline_model_parallel_layout: '<{LAYOUT_CLASS} object at 0x7f3a>'\n",
    "null": "model:\n  pipeline_model_parallel_layout: null\n",
    "absent": "model:\n  num_layers: 43\n",
}


def _upstream():
    if importlib.util.find_spec(UPSTREAM_MODULE) is None:
        pytest.skip(f"megatron-bridge {PIN} ships no DeepSeek-V4 layout function (first released in 0.5.0)")
    return importlib.import_module(UPSTREAM_MODULE)


def _saved_run(root: Path, text: str, *, in_iter: bool) -> Path:
    where = root / "iter_0000100" if in_iter else root
    where.mkdir(parents=True, exist_ok=True)
    (where / "run_config.yaml").write_text(text)
    return root


def _shape(cfg) -> dict:
    return {
        "num_layers": cfg.num_hidden_layers,
        "num_hash_layers": cfg.mlp_layer_types.count("hash_moe"),
        "mtp_layers": cfg.num_nextn_predict_layers,
    }


def _as_lists(layout) -> list[list[str]]:
    return [list(stage) for stage in layout]


@pytest.mark.parametrize("which", list(CONFIGS))
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_a_stubbed_layout_is_regenerated_as_megatron_bridge_generates_it(impl, tmp_path, which, pp):
    upstream = _upstream()
    cfg = CONFIGS[which]()
    run = _saved_run(tmp_path, STUBS["target-stub"], in_iter=True)
    ours = _as_lists(impl.run_pipeline_layout(run, stages=pp, **_shape(cfg)))
    mtp = cfg.num_nextn_predict_layers
    bridge = upstream.DeepSeekV4Bridge.generate_pipeline_layout(cfg.num_hidden_layers, pp, mtp)
    assert ours == bridge, f"megatron-bridge {PIN}, {which} PP={pp}: ours {ours}\nBridge {bridge}"
    provider = SimpleNamespace(pipeline_model_parallel_size=pp, num_layers=cfg.num_hidden_layers, mtp_num_layers=mtp)
    upstream.set_deepseek_v4_pipeline_model_parallel_layout(provider)
    assert ours == provider.pipeline_model_parallel_layout, f"{which} PP={pp}: the recipe-side function differs"


@pytest.mark.parametrize("in_iter", [False, True], ids=["run-dir", "iter-dir"])
@pytest.mark.parametrize("stub", list(STUBS))
def test_every_kind_of_lost_layout_is_regenerated(impl, tmp_path, stub, in_iter):
    upstream = _upstream()
    run = _saved_run(tmp_path, STUBS[stub], in_iter=in_iter)
    got = impl.run_pipeline_layout(run, stages=4, num_layers=43, num_hash_layers=3, mtp_layers=1)
    assert _as_lists(got) == upstream.DeepSeekV4Bridge.generate_pipeline_layout(43, 4, 1), f"{stub}: {got}"


def test_a_concrete_saved_layout_is_used_as_recorded_even_beside_a_stub(impl, tmp_path):
    """Upstream reads the first list it finds; an uneven recorded layout must survive (a regenerated one is even)."""
    recorded = [["embedding", "decoder", "decoder", "decoder"], ["decoder", "mtp", "loss"]]
    run = _saved_run(tmp_path, STUBS["target-stub"], in_iter=False)
    (run / "iter_0000100").mkdir()
    lines = "\n".join(f"    - [{', '.join(stage)}]" for stage in recorded)
    (run / "iter_0000100" / "run_config.yaml").write_text(f"model:\n  pipeline_model_parallel_layout:\n{lines}\n")
    got = impl.run_pipeline_layout(run, stages=2, num_layers=4, num_hash_layers=1, mtp_layers=1)
    assert _as_lists(got) == recorded


def test_an_unreadable_run_config_is_a_typed_error_naming_the_file(impl, tmp_path):
    run = _saved_run(tmp_path, "model: [unclosed\n", in_iter=False)
    with pytest.raises(impl.PipelineLayoutError, match="run_config.yaml"):
        impl.run_pipeline_layout(run, stages=2, num_layers=4)


def test_a_missing_run_directory_is_a_typed_error(impl, tmp_path):
    with pytest.raises(impl.PipelineLayoutError, match="no saved run directory"):
        impl.run_pipeline_layout(tmp_path / "nope", stages=2, num_layers=4)

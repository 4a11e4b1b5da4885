"""``expert_dtype`` in either place: the released V4 configs carry it at the top level; transformers 5.23's
``DeepseekV4Config.__post_init__`` moves it into ``quantization_config`` ("V4.1 ships expert_dtype in the quantization
config, so V4's moves there too"), so the same base re-saved by a newer transformers has it there. The base reader,
coverage and the base fingerprint an adapter carries must read both as the same base."""

from __future__ import annotations

import json
import shutil

import pytest

from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PRESET = "tiny-mixed"


def _with_config(src, dst, change):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def _on_top(config):
    config["expert_dtype"] = "fp4"


def _nested(config):  # what transformers 5.23 writes back
    config.setdefault("quantization_config", {})["expert_dtype"] = config.pop("expert_dtype", "fp4")


@pytest.fixture(scope="module")
def bases(impl, tmp_path_factory):
    root = tmp_path_factory.mktemp("expert-dtype")
    plain = write_checkpoint(PRESET, root / "plain", seed=3)
    on_top = _with_config(plain, root / "on-top", _on_top)
    nested = _with_config(on_top, root / "nested", _nested)
    other = _with_config(on_top, root / "other", lambda c: c.update(expert_dtype="bf16"))
    cfg = get_preset(PRESET)
    shapes = config_attention_shapes(cfg)
    names = [f"layers.{i}.attn.{leaf}.weight" for i in range(cfg.num_hidden_layers) for leaf in shapes]
    state = impl.AdapterState(make_native_adapter(shapes, cfg.num_hidden_layers, 4, seed=5), r=4, alpha=8.0)
    adapter = root / "adapter"
    impl.export_adapter(state, adapter, base_fingerprint=impl.base_fingerprint(on_top, names))
    return {"on-top": on_top, "nested": nested, "other": other, "adapter": adapter}


@pytest.mark.parametrize("place", ["on-top", "nested"])
def test_the_base_reader_and_coverage_accept_expert_dtype_in_either_place(impl, bases, place):
    read = impl.inspect_base(bases[place], transformers_config=True)
    assert read.ok, [p.message for p in read.problems]
    totals = impl.coverage_report(bases[place]).totals
    assert totals["unmapped"] == 0 and totals["missing"] == 0, totals


def test_an_adapter_fingerprinted_on_one_placement_verifies_on_the_other(impl, bases):
    result = impl.verify_adapter(bases["nested"], bases["adapter"])
    assert result.ok, f"expert_dtype moved into quantization_config reads as another base: {result.problems}"


def test_a_different_expert_dtype_is_still_another_base(impl, bases):
    result = impl.verify_adapter(bases["other"], bases["adapter"])
    assert not result.ok and any("config.json" in p for p in result.problems), result.problems

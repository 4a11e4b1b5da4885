"""Tensor manifests: the official on-disk layout of any V4 config, from the config alone.

Expected Flash figures are independent published numbers (``docs/reference/flash_names.md``,
``docs/reference/v4_architecture.md`` §3.2): 69,187 tensors, 1,575 under ``mtp.0.``, index ``total_size``
159,609,485,896 bytes, the dtype census, per-layer counts and the shape table.
"""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models.errors import ManifestError
from tiny_models.manifest import dtype_counts, manifest, manifest_of_checkpoint
from tiny_models.presets import CSA, HCA, PRESETS, flash_config, get_preset, pro_config

pytestmark = pytest.mark.cpu

# Until conftest registers the plugin ``fixtures.data.tiny_checkpoint_cache`` (then delete this line).

BYTES = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I64": 8, "I8": 1}


@pytest.fixture(scope="module")
def flash_quantized():
    return manifest(flash_config(), with_scales=True)


def test_flash_quantized_manifest_matches_the_published_counts(flash_quantized):
    names = [s.name for s in flash_quantized]
    assert len(names) == 69_187
    assert len(set(names)) == len(names), "duplicate tensor names"
    assert sum(n.startswith("mtp.0.") for n in names) == 1_575
    assert dtype_counts(flash_quantized) == {
        "BF16": 433,
        "F32": 417,
        "F8_E4M3": 375,
        "F8_E8M0": 34_167,
        "I64": 3,
        "I8": 33_792,
    }


def test_flash_quantized_manifest_totals_the_published_index_size(flash_quantized):
    total = sum(math.prod(s.shape) * BYTES[s.dtype] for s in flash_quantized)
    assert total == 159_609_485_896, f"total bytes {total:,} != index total_size 159,609,485,896"
    mtp = sum(math.prod(s.shape) * BYTES[s.dtype] for s in flash_quantized if s.name.startswith("mtp."))
    assert mtp == 3_593_787_756, f"mtp.0 bytes {mtp:,}"


def test_flash_per_layer_counts_match_the_published_templates(flash_quantized):
    per_layer: dict[int, int] = {}
    for s in flash_quantized:
        if s.name.startswith("layers."):
            layer = int(s.name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + 1
    assert per_layer[0] == per_layer[1] == 1_565, "sliding + hash layers"
    assert all(per_layer[i] == 1_576 for i in range(2, 43, 2)), "CSA layers"
    assert all(per_layer[i] == 1_569 for i in range(3, 42, 2)), "HCA layers"


def test_flash_manifest_shapes_and_dtypes_follow_the_published_table(flash_quantized):
    spec = {s.name: (s.shape, s.dtype) for s in flash_quantized}
    expected = {
        "embed.weight": ((129_280, 4096), "BF16"),
        "hc_head_fn": ((4, 16_384), "F32"),
        "layers.0.hc_attn_fn": ((24, 16_384), "F32"),
        "layers.0.hc_attn_scale": ((3,), "F32"),
        "layers.0.attn.attn_sink": ((64,), "F32"),
        "layers.0.attn.wq_a.weight": ((1024, 4096), "F8_E4M3"),
        "layers.0.attn.wq_a.scale": ((8, 32), "F8_E8M0"),
        "layers.0.attn.wq_b.scale": ((256, 8), "F8_E8M0"),
        "layers.0.attn.wo_a.weight": ((8192, 4096), "F8_E4M3"),
        "layers.0.attn.wo_a.scale": ((64, 32), "F8_E8M0"),
        "layers.0.attn.wo_b.scale": ((32, 64), "F8_E8M0"),
        "layers.0.ffn.gate.tid2eid": ((129_280, 6), "I64"),
        "layers.0.ffn.experts.0.w1.weight": ((2048, 2048), "I8"),
        "layers.0.ffn.experts.0.w1.scale": ((2048, 128), "F8_E8M0"),
        "layers.0.ffn.experts.255.w2.weight": ((4096, 1024), "I8"),
        "layers.0.ffn.experts.255.w2.scale": ((4096, 64), "F8_E8M0"),
        "layers.0.ffn.shared_experts.w2.scale": ((32, 16), "F8_E8M0"),
        "layers.2.attn.compressor.ape": ((4, 1024), "F32"),
        "layers.2.attn.compressor.wkv.weight": ((1024, 4096), "BF16"),
        "layers.2.attn.indexer.wq_b.scale": ((64, 8), "F8_E8M0"),
        "layers.2.attn.indexer.weights_proj.weight": ((64, 4096), "BF16"),
        "layers.2.attn.indexer.compressor.ape": ((4, 256), "F32"),
        "layers.3.attn.compressor.ape": ((128, 512), "F32"),
        "layers.3.ffn.gate.bias": ((256,), "F32"),
        "mtp.0.e_proj.scale": ((32, 32), "F8_E8M0"),
        "mtp.0.hc_head_base": ((4,), "F32"),
    }
    for name, want in expected.items():
        assert spec.get(name) == want, f"{name}: manifest says {spec.get(name)}, published {want}"
    assert "layers.3.attn.indexer.wq_b.weight" not in spec, "HCA layers have no indexer"
    assert "layers.2.attn.indexer.scorer.weights_proj.weight" not in spec, "on-disk name is the flat weights_proj"


def test_unquantized_flash_manifest_has_no_scales():
    specs = manifest(flash_config(), with_scales=False, dtype=torch.bfloat16)
    assert len(specs) == 69_187 - 34_167, "one tensor per weight, no .scale companions"
    assert not any(s.name.endswith(".scale") for s in specs)


def test_manifest_without_mtp_drops_exactly_the_mtp_block(flash_quantized):
    without = manifest(flash_config(), with_scales=True, include_mtp=False)
    assert len(flash_quantized) - len(without) == 1_575
    assert not any(s.name.startswith("mtp.") for s in without)


def test_pro_manifest_builds_from_the_per_layer_templates():
    cfg = pro_config()
    specs = manifest(cfg, with_scales=True)
    per_expert_set = 6 * cfg.n_routed_experts  # w1/w2/w3 weight + scale
    # Non-expert template sizes read off the Flash figures: HCA 33, CSA 40, MTP 39, globals 6.
    n_csa, n_hca = cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)
    expected = 6 + n_hca * (33 + per_expert_set) + n_csa * (40 + per_expert_set) + (39 + per_expert_set)
    assert (n_csa, n_hca) == (30, 31), "Pro schedule: layers 0, 1 and odd 3..59 HCA, even 2..60 CSA"
    assert len(specs) == expected, f"Pro manifest has {len(specs):,} tensors, templates give {expected:,}"
    assert len({s.name for s in specs}) == len(specs)
    print(f"Pro quantized manifest: {len(specs):,} tensors, dtypes {dtype_counts(specs)}")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_manifest_of_each_preset_equals_the_written_checkpoint(preset, tiny_ckpt_factory):
    written = manifest_of_checkpoint(tiny_ckpt_factory(preset))
    expected = manifest(get_preset(preset))
    assert len(written) == len({s.name for s in written}), f"{preset}: duplicate names on disk"
    missing = sorted(set(expected) - set(written))
    extra = sorted(set(written) - set(expected))
    assert not missing and not extra, f"{preset}: not written {missing[:5]}, unexpected {extra[:5]}"


def test_bf16_manifest_equals_the_written_bf16_checkpoint(tiny_ckpt_factory):
    written = manifest_of_checkpoint(tiny_ckpt_factory("tiny-mixed", dtype=torch.bfloat16))
    assert set(written) == set(manifest(get_preset("tiny-mixed"), dtype=torch.bfloat16))


def test_mxfp4_manifest_rejects_expert_input_dims_not_divisible_by_32():
    cfg = get_preset("tiny-tp")  # moe_intermediate_size 16: w2's input dim cannot pack into 32-groups
    with pytest.raises(ManifestError, match=r"experts\.0\.w2\.weight"):
        manifest(cfg, with_scales=True)


def test_manifest_of_checkpoint_rejects_a_directory_without_safetensors(tmp_path):
    with pytest.raises(ManifestError, match="no \\*.safetensors"):
        manifest_of_checkpoint(tmp_path)

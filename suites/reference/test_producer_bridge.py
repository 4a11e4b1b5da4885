"""Megatron-Bridge as a producer: its own adapter export (``AutoBridge.save_hf_adapter``, whose tensors come from
``stream_adapter_weights_megatron_to_hf``) run on the native graph with Bridge's own LoRA, and what
``verify-adapter`` and ``export`` make of what it writes (``fixtures/data/producers_bridge.py`` says how it is run).

``AutoBridge`` picks upstream's ``DeepSeekV4Bridge`` for a V4 checkpoint where the pin has one (0.5+); its adapter
export stops on the first native adapter with an ``AssertionError`` (recorded below, so a Bridge that changes this
fails the test). With the model bridge registered for the native graph in its place, Bridge's own code writes a PEFT
directory in the checkpoint's names, ``r`` / ``lora_alpha`` from the config it is handed and (0.5+) a
``rank_pattern`` entry for each module whose rank differs from that ``r``. Every Bridge pin runs this file.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from packaging.version import Version
from safetensors import safe_open

from fixtures.data.producers_bridge import (
    ALPHA,
    BRIDGE_MATRIX,
    PRESET,
    TARGETS,
    R,
    bridge_adapters,
    bridge_version,
    trained_native,
)
from fixtures.runner.subproc import run
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu


def _has_upstream_v4_bridge() -> bool:
    return importlib.util.find_spec("megatron.bridge.models.deepseek.deepseek_v4_bridge") is not None


@pytest.fixture(scope="module")
def made(impl, tmp_path_factory):
    """(base dir, the trained native model, spec -> the adapter Bridge wrote)."""
    root = tmp_path_factory.mktemp("bridge-producer")
    base = write_checkpoint(PRESET, root / "base")
    model, lora = trained_native(impl)
    return base, model, bridge_adapters(impl, base, model, lora, root / "adapters")


def test_autobridge_exports_the_native_graph_only_where_the_pin_has_no_upstream_v4_bridge(made):
    """AutoBridge dispatches on the checkpoint's architecture: upstream's ``DeepSeekV4Bridge`` where the pin has one
    (it has no mapping for the native graph's names: the export stops on the first native adapter), otherwise the
    model bridge the implementation registers, whose export yields every LoRA tensor."""
    from megatron.bridge import AutoBridge

    base, model, _ = made
    bridge = AutoBridge.from_hf_pretrained(str(base))
    if _has_upstream_v4_bridge():
        with pytest.raises(
            AssertionError, match=r"Expected mapping for adapter base 'decoder\.layers\.\d+\.self_attention"
        ):
            list(bridge.export_adapter_weights([model], cpu=True, show_progress=False))
        return
    names = {w.param_name for w in bridge.export_adapter_weights([model], cpu=True, show_progress=False)}
    layers = get_preset(PRESET).num_hidden_layers
    want = {f"layers.{i}.attn.{t}.lora_{h}.weight" for i in range(layers) for t in TARGETS for h in "AB"}
    assert names == want, f"unexpected {sorted(names - want)[:4]}, missing {sorted(want - names)[:4]}"


def test_bridges_own_save_hf_adapter_writes_checkpoint_names_with_the_loras_rank(made):
    adapter = made[2]["the-training-lora"]
    layers = get_preset(PRESET).num_hidden_layers
    want = {
        f"base_model.model.layers.{i}.attn.{t}.lora_{h}.weight" for i in range(layers) for t in TARGETS for h in "AB"
    }
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == want, f"unexpected {sorted(names - want)[:4]}, missing {sorted(want - names)[:4]}"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (R, ALPHA), config
    assert not config.get("rank_pattern"), config["rank_pattern"]  # every module has the LoRA's rank


def test_verify_adapter_finds_bridges_adapter_sound_and_uncertified(impl, made):
    result = impl.verify_adapter(made[0], made[2]["the-training-lora"])
    assert result.ok, result.problems
    assert result.uncertified, [(c.name, c.status, c.figure) for c in result.checks]


def test_a_config_without_dim_and_alpha_gets_bridges_defaults_and_verify_names_what_is_wrong(impl, made):
    """Bridge writes r=32 and lora_alpha=32. Bridge >= 0.5 adds the real rank per module in rank_pattern: PEFT scales
    by 32/4, an engine by 32/32; the shapes are judged by the pattern's rank, as PEFT reads them: one problem line, the
    scale. Bridge 0.4 writes no rank_pattern: every tensor's shape contradicts r=32, and each is named."""
    adapter = made[2]["config-without-dim-alpha"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    result = impl.verify_adapter(made[0], adapter)
    if Version(bridge_version()) < Version("0.5"):
        assert config["r"] == 32 and not config.get("rank_pattern"), config
        layers = get_preset(PRESET).num_hidden_layers
        want = {f"layers.{i}.attn.{t}.lora_{h}" for i in range(layers) for t in TARGETS for h in "AB"}
        named = {p.split(":")[0] for p in result.problems if "expected" in p and "(r=32)" in p}
        assert named == want, f"not named {sorted(want - named)[:4]}; problems {result.problems[:4]}"
        return
    assert config["r"] == 32 and set(config["rank_pattern"].values()) == {R}, config
    assert len(result.problems) == 1 and "rank_pattern" in result.problems[0], result.problems


def test_export_republishes_bridges_adapter_for_peft_and_peft_applies_all_of_it(impl, made, tmp_path):
    """The checkpoint names PEFT's transformers model does not have: export re-publishes them in its dialect, and
    stock PEFT then loads every tensor."""
    peft = pytest.importorskip("peft")
    from tiny_models.oracle import load_oracle

    adapter, out = made[2]["the-training-lora"], tmp_path / "for-peft"
    argv = ["export", "--adapter", adapter, "--out", out, "--consumer", "peft"]
    done = run([sys.executable, "-m", f"{impl.name}.cli", *map(str, argv)], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model = peft.PeftModel.from_pretrained(load_oracle(made[0]), str(out))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        assert len(loaded) == len(list(f.keys())), f"PEFT holds {len(loaded)} LoRA tensors"
    # PEFT initialises lora_B to zero: a non-zero one was read from the file
    unread = [n for n, p in loaded.items() if "lora_B" in n and not p.detach().abs().sum() > 0]
    assert not unread, f"PEFT left these at their zero init: {unread[:4]}"


def test_the_bridge_producer_matrix_in_the_docs_is_what_the_commands_say_now(impl, made):
    from fixtures.data.producers import matrix_rows, render_matrix

    if bridge_version() != impl.LANES["main"]["megatron-bridge"]:
        pytest.skip(f"the table is of the main lane's Megatron-Bridge; this is {bridge_version()}")
    rows = matrix_rows(
        impl.name, made[0], made[2], producer="Megatron-Bridge save_hf_adapter", version=bridge_version()
    )
    assert BRIDGE_MATRIX.section(BRIDGE_MATRIX.path.read_text()) == render_matrix(rows), (
        "docs/producers.md's Megatron-Bridge table is stale: run .venv/bin/python scripts/producer_matrix.py --write"
    )

"""The upstream Megatron-Core layout, read from the same mapping table: every official Flash and Pro tensor name
maps to the name Megatron-Bridge's own ``DeepSeekV4Bridge`` registry gives it, and back, name for name.

The oracle is the installed pin's registry (``hf_to_megatron_lookup`` / ``megatron_to_hf_lookup``), never our own
table. Where the registry misses a name of the official checkpoint, :data:`BRIDGE_GAPS` says which and why; the
gap is detected on the registry itself (not looked up by version), and a gap that closes fails the test so that
its row gets removed.
"""

import functools
import importlib
import importlib.metadata
import importlib.util
import re

import pytest

from tiny_models.manifest import manifest
from tiny_models.presets import flash_config, pro_config

pytestmark = pytest.mark.cpu

PIN = importlib.metadata.version("megatron-bridge")
UPSTREAM_MODULE = "megatron.bridge.models.deepseek.deepseek_v4_bridge"
CONFIGS = {"flash": flash_config, "pro": pro_config}
INDEX = re.compile(r"\.([0-9]+)(?=\.)")


class Gap:
    """One family of official names Megatron-Bridge's registry does not resolve, what it answers instead, why."""

    def __init__(self, official: str, bridge: str, probe: str, why: str):
        self.official, self.bridge, self.probe, self.why = official, bridge, probe, why

    def applies(self, registry) -> bool:
        return registry.hf_to_megatron_lookup(self.probe) is not None

    def bridge_name(self, official: str) -> str:
        return official.replace(self.official, self.bridge)


BRIDGE_GAPS = (
    Gap(
        official=".attn.indexer.weights_proj.",
        bridge=".attn.indexer.scorer.weights_proj.",
        probe="layers.2.attn.indexer.scorer.weights_proj.weight",
        why="Megatron-Bridge 0.6 registers the CSA indexer scorer under transformers' module path "
        "(indexer.scorer.weights_proj); official checkpoints store it flat (indexer.weights_proj), which Bridge "
        "bridges outside its registry (maybe_modify_loaded_hf_weight on import, maybe_modify_converted_hf_weight "
        "renames back on export). 0.5.x registers the flat name and has no gap.",
    ),
)


@functools.cache
def _official_names(which: str) -> tuple[str, ...]:
    return tuple(s.name for s in manifest(CONFIGS[which]()))


@functools.cache
def _registry(which: str):
    if importlib.util.find_spec(UPSTREAM_MODULE) is None:
        pytest.skip(f"megatron-bridge {PIN} has no DeepSeekV4Bridge (first released in 0.5.0): no oracle here")
    bridge = importlib.import_module(UPSTREAM_MODULE).DeepSeekV4Bridge()
    bridge.hf_config = CONFIGS[which]()
    return bridge.mapping_registry()


def _hf_names(mapping) -> tuple[str, ...]:
    hf = mapping.hf_param
    return (hf,) if isinstance(hf, str) else (hf["gate"], hf["up"])


def _fill(pattern: str, captures: list[str]) -> str:
    pieces = pattern.split("*")
    assert len(pieces) == len(captures) + 1, f"{pattern} takes {len(pieces) - 1} indices, got {captures}"
    return "".join(p + c for p, c in zip(pieces, [*captures, ""], strict=True))


@pytest.mark.parametrize("which", list(CONFIGS))
def test_every_official_name_maps_to_the_upstream_name_megatron_bridge_gives(impl, which):
    registry = _registry(which)  # imports megatron.bridge: impl (the fixture) installed its CPU stubs first
    gaps = [g for g in BRIDGE_GAPS if g.applies(registry)]
    wrong, missed = [], []
    for name in _official_names(which):
        ours = impl.lookup_official_upstream(name)
        assert ours is not None, f"megatron-bridge {PIN}: official {name} has no upstream name in our table"
        theirs = registry.hf_to_megatron_lookup(name)
        if theirs is None:
            missed.append(name)
        elif ours[2] != theirs.megatron_param:
            wrong.append(f"{name}: ours {ours[2]}, Megatron-Bridge {theirs.megatron_param}")
    assert not wrong, f"megatron-bridge {PIN}, {which}: {len(wrong)} names differ, e.g. " + "; ".join(wrong[:5])
    explained = [n for n in _official_names(which) if any(g.official in n for g in gaps)]
    assert missed == explained, (
        f"megatron-bridge {PIN}, {which}: the registry misses {missed[:5]} (of {len(missed)}); documented gaps "
        f"cover {explained[:5]} (of {len(explained)})"
    )


@pytest.mark.parametrize("which", list(CONFIGS))
def test_every_upstream_name_maps_back_to_the_official_name_megatron_bridge_gives(impl, which):
    registry = _registry(which)
    gaps = [g for g in BRIDGE_GAPS if g.applies(registry)]
    upstream: dict[str, tuple[str, ...]] = {}  # upstream name -> official names of its row
    for name in _official_names(which):
        _, row, _, _ = impl.lookup_official_upstream(name)
        for pattern in row.upstream_names:  # the three hyper-connection alphas of one scale, both halves of fc1
            upstream.setdefault(_fill(pattern, INDEX.findall(name)), ())
    wrong = []
    for up in upstream:
        ours = impl.lookup_upstream(up)
        theirs = registry.megatron_to_hf_lookup(up)
        assert ours is not None, f"our upstream name {up} does not resolve back"
        assert theirs is not None, f"megatron-bridge {PIN}: {up} (our upstream name) is not in Bridge's registry"
        expected = tuple(_bridge_expected(o, gaps) for o in ours[2])
        if expected != _hf_names(theirs):
            wrong.append(f"{up}: ours {ours[2]}, Megatron-Bridge {_hf_names(theirs)}")
    assert not wrong, f"megatron-bridge {PIN}, {which}: {len(wrong)} names differ, e.g. " + "; ".join(wrong[:5])


def _bridge_expected(official: str, gaps: list[Gap]) -> str:
    for gap in gaps:
        if gap.official in official:
            return gap.bridge_name(official)
    return official


def test_the_three_hyper_connection_alphas_come_from_one_official_scale(impl):
    """Upstream splits ``hc_attn_scale`` [3] into three [1] parameters; each resolves to the one official tensor, and
    the official name answers the first part as Megatron-Bridge's registry does."""
    parts = ("alpha_pre", "alpha_post", "alpha_res")
    prefix = "decoder.layers.5.self_attention_hyper_connection."
    for part in parts:
        hit = impl.lookup_upstream(prefix + part)
        assert hit is not None and hit[2] == ("layers.5.hc_attn_scale",), f"{prefix + part} -> {hit}"
    official, row, first, _ = impl.lookup_official_upstream("mtp.0.hc_ffn_scale")
    assert first == "mtp.layers.0.mtp_model_layer.mlp_hyper_connection.alpha_pre", first
    assert [p.rsplit(".", 1)[1] for p in row.upstream_names] == list(parts), row.upstream_names


def test_routed_experts_use_the_grouped_gemm_names_with_the_global_expert_index(impl):
    _, _, up, role = impl.lookup_official_upstream("layers.7.ffn.experts.200.w3.weight")
    assert (up, role) == ("decoder.layers.7.mlp.experts.linear_fc1.weight200", "up"), (up, role)
    hit = impl.lookup_upstream("decoder.layers.7.mlp.experts.linear_fc2.weight200")
    assert hit is not None and hit[2] == ("layers.7.ffn.experts.200.w2.weight",), hit
    # The index is the whole digit run after "weight": no prefix of it is another expert.
    assert impl.lookup_upstream("decoder.layers.7.mlp.experts.linear_fc2.weight") is None
    assert impl.lookup_upstream("decoder.layers.7.mlp.experts.linear_fc2.weightx2") is None


def test_miles_names_are_not_upstream_names_where_the_layouts_differ(impl):
    """The two layouts share only the names they really share (norms, router, shared experts, embeddings)."""
    assert impl.lookup_upstream("decoder.layers.0.self_attention.wq_b.weight") is None
    assert impl.lookup_native("decoder.layers.0.self_attention.linear_q_up_proj.weight") is None
    shared = "decoder.layers.0.mlp.router.weight"
    assert impl.lookup_upstream(shared)[2] == impl.lookup_native(shared)[2] == ("layers.0.ffn.gate.weight",)

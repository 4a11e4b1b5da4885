"""The checkpoint-name table: one meaning per name, Megatron-Bridge mapping class per group, V4 rows win."""

import itertools
import re
from collections import Counter
from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from tiny_models.manifest import manifest
from tiny_models.presets import flash_config

pytestmark = pytest.mark.cpu

# (group, native name, official name(s), Megatron-Bridge class name); megatron.bridge imports only after impl's compat

REPRESENTATIVES = [
    ("embedding", "embedding.word_embeddings.weight", ("embed.weight",), "ColumnParallelMapping"),
    ("embedding", "output_layer.weight", ("head.weight",), "ColumnParallelMapping"),
    ("norm", "decoder.layers.2.input_layernorm.weight", ("layers.2.attn_norm.weight",), "ReplicatedMapping"),
    ("hyper_connection", "decoder.layers.1.hc_ffn_scale", ("layers.1.hc_ffn_scale",), "ReplicatedMapping"),
    ("hyper_connection", "decoder.hc_head_params.hc_head_fn", ("hc_head_fn",), "ReplicatedMapping"),
    ("attention", "decoder.layers.0.self_attention.wq_a.weight", ("layers.0.attn.wq_a.weight",), "ReplicatedMapping"),
    (
        "attention",
        "decoder.layers.0.self_attention.wq_b.weight",
        ("layers.0.attn.wq_b.weight",),
        "ColumnParallelMapping",
    ),
    (
        "attention",
        "decoder.layers.0.self_attention.wo_a.weight",
        ("layers.0.attn.wo_a.weight",),
        "ColumnParallelMapping",
    ),
    ("attention", "decoder.layers.0.self_attention.wo_b.weight", ("layers.0.attn.wo_b.weight",), "RowParallelMapping"),
    (
        "attention_sink",
        "decoder.layers.3.self_attention.attn_sink",
        ("layers.3.attn.attn_sink",),
        "ColumnParallelMapping",
    ),
    (
        "compressor",
        "decoder.layers.2.self_attention.compressor.ape",
        ("layers.2.attn.compressor.ape",),
        "ReplicatedMapping",
    ),
    (
        "indexer",
        "decoder.layers.2.self_attention.indexer.linear_wq_b.weight",
        ("layers.2.attn.indexer.wq_b.weight",),
        "ReplicatedMapping",
    ),
    ("routing", "decoder.layers.0.mlp.router.tid2eid", ("layers.0.ffn.gate.tid2eid",), "ReplicatedMapping"),
    ("routing", "decoder.layers.5.mlp.router.expert_bias", ("layers.5.ffn.gate.bias",), "ReplicatedMapping"),
    (
        "expert",
        "decoder.layers.4.mlp.experts.local_experts.7.linear_fc1.weight",
        ("layers.4.ffn.experts.7.w1.weight", "layers.4.ffn.experts.7.w3.weight"),
        "GatedMLPMapping",
    ),
    (
        "expert",
        "decoder.layers.4.mlp.experts.local_experts.7.linear_fc2.weight",
        ("layers.4.ffn.experts.7.w2.weight",),
        "RowParallelMapping",
    ),
    (
        "shared_expert",
        "decoder.layers.4.mlp.shared_experts.linear_fc1.weight",
        ("layers.4.ffn.shared_experts.w1.weight", "layers.4.ffn.shared_experts.w3.weight"),
        "GatedMLPMapping",
    ),
    ("mtp", "mtp.layers.0.final_layernorm.weight", ("mtp.0.norm.weight",), "ReplicatedMapping"),
    (
        "attention",
        "mtp.layers.0.mtp_model_layer.self_attention.wq_b.weight",
        ("mtp.0.attn.wq_b.weight",),
        "ColumnParallelMapping",
    ),
]


def _hf_names(mapping) -> tuple[str, ...]:
    hf = mapping.hf_param
    return (hf,) if isinstance(hf, str) else (hf["gate"], hf["up"])


@pytest.mark.parametrize(("group", "native", "official", "cls"), REPRESENTATIVES, ids=lambda v: str(v)[:60])
def test_group_builds_the_pinned_megatron_bridge_mapping(impl, group, native, official, cls):
    mapping = impl.DeepseekV4ConversionBridge().mapping_registry().megatron_to_hf_lookup(native)
    assert mapping is not None, f"no mapping for native {native}"
    from megatron.bridge.models.conversion import param_mapping

    expected = getattr(param_mapping, cls)
    assert type(mapping) is expected, f"{native} ({group}) built {type(mapping).__name__}, expected {cls}"
    assert _hf_names(mapping) == official, f"{native} maps to {_hf_names(mapping)}"
    _, row, _ = impl.lookup_native(native)
    assert row.group == group, f"{native} is in group {row.group}"


def test_v4_rows_win_over_generic_deepseek_rows(impl):
    """The generic list maps the same native router/expert names to V3 names; first match wins, V4 is first."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.deepseek.common import get_common_mapping_list

    name = "decoder.layers.3.mlp.router.weight"
    ours = impl.DeepseekV4ConversionBridge().mapping_registry()
    generic_first = MegatronMappingRegistry(*get_common_mapping_list(), *list(ours)[: len(impl.MAPPING_TABLE)])
    assert generic_first.megatron_to_hf_lookup(name).hf_param == "model.layers.3.mlp.gate.weight"
    assert ours.megatron_to_hf_lookup(name).hf_param == "layers.3.ffn.gate.weight", "V4 row lost to a generic row"
    fc2 = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"
    assert ours.megatron_to_hf_lookup(fc2).hf_param == "layers.3.ffn.experts.1.w2.weight"


class _Claims:
    """The suite's own reading of a table: which rows claim a name. ``*`` is one whole segment of ASCII digits, every
    other segment is literal. A name is looked up under each way of replacing its digit segments by ``*``, in a
    count of patterns, so a duplicated row or a row with a literal index (``layers.3.``) overlapping a wildcard row
    (``layers.*.``) counts twice; patterns with a ``*`` inside a segment are matched one by one."""

    def __init__(self, table, side: str):
        self.patterns: Counter[str] = Counter()
        self.odd: list[tuple[re.Pattern[str], str]] = []
        for row in table:
            for pattern in row.official_names if side == "official" else (row.native,):
                if all(seg == "*" or "*" not in seg for seg in pattern.split(".")):
                    self.patterns[pattern] += 1
                else:
                    regex = "[.]".join(
                        "[0-9]+" if s == "*" else re.escape(s).replace(r"\*", "[0-9]+") for s in pattern.split(".")
                    )
                    self.odd.append((re.compile(regex), pattern))

    def count(self, name: str) -> int:
        segs = name.split(".")
        digits = [i for i, seg in enumerate(segs) if seg.isascii() and seg.isdigit()]
        n = 0
        for stars in itertools.product((False, True), repeat=len(digits)):
            variant = list(segs)
            for i, star in zip(digits, stars, strict=True):
                if star:
                    variant[i] = "*"
            n += self.patterns.get(".".join(variant), 0)
        return n + sum(1 for regex, _ in self.odd if regex.fullmatch(name))


def test_every_flash_name_resolves_both_ways_exactly_once(impl):
    official_claims, native_claims = _Claims(impl.MAPPING_TABLE, "official"), _Claims(impl.MAPPING_TABLE, "native")
    for spec in manifest(flash_config(), with_scales=False):
        assert official_claims.count(spec.name) == 1, f"official {spec.name}: {official_claims.count(spec.name)} rows"
        fwd = impl.lookup_official(spec.name)
        assert fwd is not None, f"official {spec.name} unmapped"
        official, _, native, _ = fwd
        assert official == spec.name, f"{spec.name} resolved as {official}"
        assert native_claims.count(native) == 1, f"native {native} ({spec.name}): {native_claims.count(native)} rows"
        back = impl.lookup_native(native)
        assert back is not None and back[0] == native and spec.name in back[2], f"{spec.name} -> {native} -> {back}"


WQ_A = "decoder.layers.*.self_attention.wq_a.weight"
# A second row that claims a name some row already claims: (the extra row, the side, that name).
OVERLAPS = {
    "a duplicated row": lambda row: (row, "native", "decoder.layers.3.self_attention.wq_a.weight"),
    "a literal official index over a wildcard": lambda row: (
        replace(row, official="layers.3.attn.wq_a.weight", native="decoder.layers.3.self_attention.wq_a2.weight"),
        "official",
        "layers.3.attn.wq_a.weight",
    ),
    "a literal native index over a wildcard": lambda row: (
        replace(row, official="layers.3.attn.wq_a2.weight", native="decoder.layers.3.self_attention.wq_a.weight"),
        "native",
        "decoder.layers.3.self_attention.wq_a.weight",
    ),
}


@pytest.mark.parametrize("overlap", OVERLAPS.values(), ids=list(OVERLAPS))
def test_a_second_row_claiming_a_name_is_counted_and_refused_by_the_table_check(impl, overlap):
    """The exactly-once count above can fail: on a copy of the table with a second row claiming one name it counts
    two, and the implementation's own table check refuses that copy."""
    (row,) = [r for r in impl.MAPPING_TABLE if r.native == WQ_A]
    extra, side, name = overlap(row)
    copy = (*impl.MAPPING_TABLE, extra)
    assert _Claims(impl.MAPPING_TABLE, side).count(name) == 1, f"{side} {name} in the real table"
    assert _Claims(copy, side).count(name) == 2, f"the count missed the second {side} claim on {name}"
    impl.check_mapping_table(impl.MAPPING_TABLE)
    with pytest.raises(impl.MappingTableError):
        impl.check_mapping_table(copy)


def test_mtp_rows_are_generated_from_the_layer_template(impl):
    layer_rows = {r.native.removeprefix("decoder.layers.*."): r for r in impl.MAPPING_TABLE if "layers.*." in r.native}
    mtp_rows = [r for r in impl.MAPPING_TABLE if r.native.startswith("mtp.layers.*.mtp_model_layer.")]
    assert mtp_rows, "no MTP rows"
    for r in mtp_rows:
        tpl = layer_rows[r.native.removeprefix("mtp.layers.*.mtp_model_layer.")]
        assert (r.semantics, r.group) == (tpl.semantics, tpl.group), f"MTP row {r.native} diverged from {tpl.native}"
        assert r.official_names == tuple(o.replace("layers.*.", "mtp.*.", 1) for o in tpl.official_names)
    assert not any("compressor" in r.native or "tid2eid" in r.native for r in mtp_rows), "MTP layer is sliding/score"


# Each is str.isdigit(); the first two are also regex \d, and int() reads them as 3.
OTHER_SCRIPTS_DIGITS = {"arabic-indic": "\u0663", "fullwidth": "\uff13", "superscript": "\u00b3"}


@pytest.mark.parametrize("digit", list(OTHER_SCRIPTS_DIGITS.values()), ids=list(OTHER_SCRIPTS_DIGITS))
def test_an_index_written_in_another_scripts_digits_resolves_nowhere(impl, digit):
    """Indices are ASCII digits: a resolver that took ``layers.\u0663`` would alias layer 3 under a name no checkpoint
    or model has, and coverage would count it as mapped."""
    for row in impl.MAPPING_TABLE:
        for pattern in (*row.official_names, row.native):
            for k in range(pattern.count("*")):  # the odd index in each wildcard position, the others ASCII
                pieces = pattern.split("*")
                name = "".join(p + (digit if i == k else "1") for i, p in enumerate(pieces[:-1])) + pieces[-1]
                lookup = impl.lookup_native if pattern == row.native else impl.lookup_official
                assert lookup(name) is None, f"{name!r} resolved to {lookup(name)}"
    odd = f"layers.{digit}.attn.wq_a.weight"
    report = impl.coverage_report([odd, "layers.3.attn.wq_a.weight"])
    assert [e.status for e in report.entries] == ["unmapped", "mapped"], report.entries
    adapter = f"decoder.layers.{digit}.self_attention.wq_a.adapter.linear_in.weight"
    halves = {adapter: torch.zeros(4, 8), adapter.replace("linear_in", "linear_out"): torch.zeros(8, 4)}
    with pytest.raises(impl.ExportError, match=re.escape(adapter)):
        impl.publish_in_memory(impl.AdapterState(halves, r=4, alpha=8.0))


def test_exactly_the_routed_expert_rows_are_per_expert(impl):
    """Export gathers a row over the expert-parallel ranks (and renumbers its experts) exactly where the row is a
    routed expert's; the shared expert and the router are whole on every rank."""
    per_expert = {r.native for r in impl.MAPPING_TABLE if r.is_expert}
    routed = {r.native for r in impl.MAPPING_TABLE if ".experts.local_experts.*." in r.native}
    assert routed, "no routed-expert rows"
    assert per_expert == routed, f"per expert, not routed: {per_expert - routed}; routed, not: {routed - per_expert}"


def test_the_tables_rows_cannot_be_changed_in_place(impl):
    """Every lookup, load and export reads this one table, through name indexes built from it at import: a row
    edited in place would disagree with them, so a different row is a new row (``dataclasses.replace``)."""
    row = impl.MAPPING_TABLE[0]
    with pytest.raises(FrozenInstanceError):
        row.native = "renamed"
    assert impl.MAPPING_TABLE[0].native != "renamed"


def test_each_rows_hf_param_is_the_one_its_megatron_bridge_mapping_holds(impl):
    """A row states the Megatron-Bridge ``hf_param`` argument its mapping is built with: one official name, or the
    ``{"gate": w1, "up": w3}`` pair of a gated row, wildcards still in place."""
    mappings = impl.DeepseekV4ConversionBridge().mapping_registry().get_all_mappings()
    for row, mapping in zip(impl.MAPPING_TABLE, mappings, strict=False):  # V4 rows first, then generic DeepSeek rows
        assert mapping.megatron_param == row.native, f"mapping {mapping.megatron_param} out of table order"
        assert row.hf_param() == mapping.hf_param, f"{row.native}: {row.hf_param()} != {mapping.hf_param}"


def test_exactly_the_mtp_layers_rows_are_mtp_rows(impl):
    """A row says it is the MTP layer's exactly where its official names are under ``mtp.*.`` (the MTP layer's
    tensors in every published checkpoint)."""
    mtp = {r.native for r in impl.MAPPING_TABLE if r.is_mtp}
    official_mtp = {r.native for r in impl.MAPPING_TABLE if all(o.startswith("mtp.*.") for o in r.official_names)}
    assert official_mtp, "no MTP rows"
    assert mtp == official_mtp, (
        f"MTP, not under mtp.*: {mtp - official_mtp}; under mtp.*, not MTP: {official_mtp - mtp}"
    )

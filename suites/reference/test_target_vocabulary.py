"""One target vocabulary: a LoRA target is one row of one table, and every consumer of target names reads it.

The V4 facts below are written out from the module tree (docs/reference/v4_architecture.md §4.2 and §8.1), independently of the
implementation's table. A fictional target (native ``wx``, official ``wx``, transformers ``x_proj``) added to a COPY
of the table then reaches the qualifier, every naming dialect, the native-name parser the gather and the exporter
read adapter names with, verify's name translation and the command line's default targets.
The names the dialects read back are values, and an MTP module translates only into the dialect that has MTP.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.cpu

MAIN = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
# native path -> (official path, transformers path, TP split of the base, nested, nested modules sharing the leaf)
V4_TARGETS = {
    "wq_a": ("wq_a", "q_a_proj", "replicated", False, set()),
    "wq_b": ("wq_b", "q_b_proj", "column", False, {"indexer.linear_wq_b"}),
    "wkv": ("wkv", "kv_proj", "replicated", False, {"compressor.wkv", "indexer.compressor.wkv"}),
    "wo_a": ("wo_a", "o_a_proj", "grouped_column", False, set()),
    "wo_b": ("wo_b", "o_b_proj", "row", False, set()),
    "indexer.linear_wq_b": ("indexer.wq_b", "compressor.indexer.q_b_proj", "replicated", True, set()),
    "indexer.linear_weights_proj": (
        "indexer.weights_proj",
        "compressor.indexer.scorer.weights_proj",
        "replicated",
        True,
        set(),
    ),
    "compressor.wkv": ("compressor.wkv", "compressor.kv_proj", "replicated", True, set()),
    "compressor.wgate": ("compressor.wgate", "compressor.gate_proj", "replicated", True, set()),
    "indexer.compressor.wkv": ("indexer.compressor.wkv", "compressor.indexer.kv_proj", "replicated", True, set()),
    "indexer.compressor.wgate": ("indexer.compressor.wgate", "compressor.indexer.gate_proj", "replicated", True, set()),
}
WX_ADAPTER = "decoder.layers.1.self_attention.wx.adapter.linear_{half}.weight"
WX_PATHS = {  # dialect -> the fictional target's module path in layer 3
    "transformers": "model.layers.3.self_attn.x_proj",
    "official": "layers.3.attn.wx",
    "sglang": "model.layers.3.self_attn.wx",
}


@pytest.fixture
def table(impl):
    """A copy of the implementation's table with one fictional main-attention target appended."""
    wx = impl.TargetRow("wx", "wx", "x_proj", "wx", impl.ParallelStyle.COLUMN, nested=False)
    return impl.TARGET_TABLE.with_rows(wx)


def test_the_table_states_every_v4_attention_target(impl):
    got = {
        r.native: (r.official, r.transformers, r.parallel.value, r.nested, set(r.also_nested_as))
        for r in impl.TARGET_TABLE.rows
    }
    assert got == V4_TARGETS
    assert tuple(impl.TARGET_TABLE.main_names) == MAIN, "the main targets, in export order"
    assert [r.native for r in impl.TARGET_TABLE.rows if r.grouped] == ["wo_a"], "only wo_a is grouped"


def test_adding_a_row_leaves_the_implementations_table_unchanged(impl, table):
    assert "wx" in table.vocabulary and table.row("x_proj").native == "wx"
    assert "wx" not in impl.TARGET_TABLE.vocabulary and impl.TARGET_TABLE.row("x_proj") is None
    assert len(table.rows) == len(impl.TARGET_TABLE.rows) + 1


def test_inconsistent_rows_are_rejected_naming_the_clash(impl):
    row = impl.TARGET_TABLE.row("wq_b")
    with pytest.raises(impl.TargetError, match="official 'wq_b' names two rows"):
        impl.TARGET_TABLE.with_rows(impl.TargetRow("wy", "wq_b", "y_proj", "wy", row.parallel, nested=False))
    with pytest.raises(impl.TargetError, match="'q_b_proj' means both 'wq_b' and 'wz'"):
        impl.TARGET_TABLE.with_rows(impl.TargetRow("wz", "q_b_proj", "z_proj", "wz", row.parallel, nested=False))
    with pytest.raises(impl.TargetError, match="'wv'.also_nested_as names 'wq_a', which is not a nested row"):
        impl.TARGET_TABLE.with_rows(
            impl.TargetRow("wv", "wv", "v_proj", "wv", row.parallel, nested=False, also_nested_as=("wq_a",))
        )


def test_the_qualifier_accepts_a_new_row(impl, table):
    assert impl.qualify_targets(["wx", "x_proj"], table=table) == ["*.self_attention.wx"] * 2
    assert impl.qualify_exclusions("x_proj", table=table) == "*.self_attention.wx"
    assert impl.qualify_targets(["x_proj"]) == ["x_proj"], "the implementation's own table must not know x_proj"
    modules = ["decoder.layers.0.self_attention.wx", "decoder.layers.0.self_attention.wq_a"]
    assert impl.qualify_targets(["x_proj"], module_names=modules, table=table) == ["*.self_attention.wx"]
    with pytest.raises(impl.TargetError, match="x_proj"):
        impl.qualify_targets(["x_proj"], module_names=modules)


@pytest.mark.parametrize("dialect", sorted(WX_PATHS))
def test_each_dialect_names_a_new_row_and_reads_it_back(impl, table, dialect):
    d, path = impl.DIALECTS[dialect], WX_PATHS[dialect]
    row = table.row("wx")
    assert d.module_name(3, row) == path
    assert d.parse_module(path, table) == (3, row)
    assert d.parse_module(path) is None, f"{dialect}: the implementation's own table must not resolve {path}"
    selection = d.target_modules([path], table)
    if isinstance(selection, str):
        assert re.fullmatch(selection, path) and not re.fullmatch(selection, path.replace("3", "4")), selection
    else:
        assert selection == ["wx"], f"{dialect}: consumer target_modules {selection}"


def test_the_native_name_parser_accepts_a_new_rows_adapter_names(impl, table):
    for half, want in (("in", "A"), ("out", "B")):
        name = WX_ADAPTER.format(half=half)
        parsed = impl.parse_native(name, table)
        assert (parsed.layer, parsed.row.native, parsed.half) == (1, "wx", want), name
        assert impl.match_native(name) is None, f"{name}: parsed without the new row"
        with pytest.raises(impl.ExportError, match="'wx', which is not one of the exportable"):
            impl.parse_native(name)


def test_verify_name_translation_maps_a_new_row_both_ways(impl, table):
    for dialect, path in WX_PATHS.items():
        ref = impl.resolve_module(path, table)
        assert (ref.dialect, ref.layer, ref.official_weight) == (dialect, 3, "layers.3.attn.wx.weight"), path
        assert impl.resolve_module(path) is None, f"{path}: resolved without the new row"
        for other, other_path in WX_PATHS.items():
            assert impl.translate_module(path, other, table) == other_path, f"{path} -> {other}"


def test_an_mtp_module_translates_only_into_a_dialect_that_has_mtp(impl):
    """Only the official naming has an MTP module (mtp.0.attn.<leaf>): translating one into transformers or SGLang
    naming gives None (their models have no MTP layer), never a decoder layer's name or an error; a path naming no
    target gives None in every dialect."""
    official = "mtp.0.attn.wq_a"
    ref = impl.resolve_module(official)
    assert (ref.dialect, ref.layer, ref.official_weight) == ("official", None, "mtp.0.attn.wq_a.weight"), ref
    got = {dialect: impl.translate_module(official, dialect) for dialect in sorted(impl.DIALECTS)}
    assert got == {"official": official, "sglang": None, "transformers": None}, f"{official} translated to {got}"
    for path in ("layers.0.ffn.gate", "model.layers.0.mlp.gate"):
        got = {dialect: impl.translate_module(path, dialect) for dialect in sorted(impl.DIALECTS)}
        assert set(got.values()) == {None}, f"{path} names no target, translated to {got}"


#: what the public API hands a caller about names: a dialect of the table, a parsed native name, a resolved module
NAME_VALUES = {
    "dialect": lambda impl: impl.DIALECTS["official"],
    "parsed native name": lambda impl: impl.parse_native(
        "decoder.layers.1.self_attention.wq_a.adapter.linear_in.weight"
    ),
    "resolved module": lambda impl: impl.resolve_module("model.layers.3.self_attn.q_a_proj"),
}


@pytest.mark.parametrize("what", sorted(NAME_VALUES))
def test_dialects_and_the_names_read_back_are_immutable_values(impl, what):
    """A caller may key a dict or fill a set with them, and none can change the shared dialect table (and with it
    every later export's names) or a result another caller holds by assigning to a field."""
    value = NAME_VALUES[what](impl)
    assert len({value, NAME_VALUES[what](impl)}) == 1, f"{what}: equal values hash apart"
    field = next(iter(vars(value)))
    with pytest.raises(AttributeError):
        setattr(value, field, None)
    assert getattr(value, field) is not None, f"{what}: its {field} was changed"


def test_cli_default_recipe_and_qualify_targets_are_the_tables_main_targets(impl, table):
    main = list(impl.TARGET_TABLE.main_names)
    assert main == list(MAIN)
    assert impl.build_parser().parse_args(["qualify"]).targets.split(",") == main
    assert impl.build_parser(table).parse_args(["qualify"]).targets.split(",") == [*main, "wx"]
    assert list(impl.deepseek_v4_flash_lora_recipe().targets) == main
    assert list(impl.MAIN_ATTENTION_TARGETS) == main

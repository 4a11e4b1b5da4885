"""LoRA target qualification: bare V4 attention names mean the MAIN attention, nested modules only when named.

The expected module sets are written out here from the V4 module tree (docs/DESIGN.md), independently of the
qualifier's own table, and matched with Megatron-Bridge's real ``ModuleMatcher`` (the consumer of the patterns).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fixtures.data.module_tree import ATTENTION_LEAVES

pytestmark = pytest.mark.cpu

ATTN = "decoder.layers.{i}.self_attention"
# every linear of a native V4 attention block with a CSA compressor + indexer, on two layers and an MTP layer
LEAVES = ATTENTION_LEAVES
SCOPES = (
    "decoder.layers.0.self_attention",
    "decoder.layers.1.self_attention",
    "mtp.layers.0.mtp_model_layer.self_attention",
)
MODULE_NAMES = tuple(f"{s}.{leaf}" for s in SCOPES for leaf in LEAVES) + (
    "decoder.layers.0.mlp.shared_experts.linear_fc1",
    "decoder.layers.0.self_attention.q_norm",
    "output_layer",
)

# what a user means by each accepted name: the native leaf path under self_attention (the spec, written out)
MEANT = {
    "wq_a": "wq_a",
    "q_a_proj": "wq_a",
    "wq_b": "wq_b",
    "q_b_proj": "wq_b",
    "wkv": "wkv",
    "kv_proj": "wkv",
    "wo_a": "wo_a",
    "o_a_proj": "wo_a",
    "wo_b": "wo_b",
    "o_b_proj": "wo_b",
    "indexer.wq_b": "indexer.linear_wq_b",
    "indexer.weights_proj": "indexer.linear_weights_proj",
    "compressor.wkv": "compressor.wkv",
    "compressor.wgate": "compressor.wgate",
    "indexer.compressor.wkv": "indexer.compressor.wkv",
    "indexer.compressor.wgate": "indexer.compressor.wgate",
}


def bridge_matched(patterns: list[str], names=MODULE_NAMES) -> set[str]:
    """Modules Megatron-Bridge's ModuleMatcher selects for ``target_modules=patterns``."""
    from megatron.bridge.peft.module_matcher import ModuleMatcher  # after the impl fixture installed the TE stub

    matcher = ModuleMatcher(target_modules=list(patterns))
    out = set()
    for full in names:
        prefix, _, leaf = full.rpartition(".")
        if matcher.match(None, leaf, prefix) is not None:
            out.add(full)
    return out


def meant(names: list[str]) -> set[str]:
    return {f"{s}.{MEANT[n]}" for n in names for s in SCOPES}


@pytest.mark.parametrize("name", sorted(MEANT))
def test_each_vocabulary_name_reaches_exactly_its_module_in_every_attention(impl, name):
    qualified = impl.qualify_targets([name])
    assert bridge_matched(qualified) == meant([name]), f"target {name!r} -> {qualified}"


def test_main_attention_targets_are_the_five_official_leaves(impl):
    assert tuple(impl.MAIN_ATTENTION_TARGETS) == ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")


def test_bare_wq_b_never_matches_the_indexer(impl):
    hit = bridge_matched(impl.qualify_targets(["wq_b", "q_b_proj"]))
    assert not [n for n in hit if "indexer" in n], f"bare wq_b reached the indexer: {sorted(hit)}"


def test_bare_wkv_never_matches_a_compressor(impl):
    hit = bridge_matched(impl.qualify_targets(["wkv"]))
    assert not [n for n in hit if "compressor" in n], f"bare wkv reached a compressor: {sorted(hit)}"
    # the unqualified leaf WOULD hit all three per block under Bridge's leaf rule: the reason qualification exists
    assert len(bridge_matched(["wkv"])) == 3 * len(SCOPES)


def test_wildcards_and_dotted_paths_pass_through_unchanged(impl):
    entries = ["*.layers.0.*.wq_b", "decoder.layers.1.self_attention.wo_b", "linear_fc1", "*.self_attention.wkv"]
    assert impl.qualify_targets(entries) == entries


def test_single_string_stays_a_string_and_falsy_is_returned_as_is(impl):
    assert impl.qualify_targets("wq_b") == "*.self_attention.wq_b"
    for falsy in (None, [], "", ()):
        assert impl.qualify_targets(falsy) is falsy
        assert impl.qualify_exclusions(falsy) is falsy


@given(st.lists(st.sampled_from([*MEANT, "*.layers.1.*", "linear_fc1", "decoder.layers.0.self_attention.wq_b"])))
def test_qualification_preserves_order_and_is_idempotent(impl, entries):
    once = impl.qualify_targets(entries)
    assert len(once) == len(entries)
    assert impl.qualify_targets(once) == once
    assert impl.qualify_exclusions(entries) == once
    for entry, q in zip(entries, once, strict=True):  # order: each output stems from the input at the same index
        assert q == entry or (entry in MEANT and q.endswith("self_attention." + MEANT[entry]))


@given(st.lists(st.sampled_from(sorted(MEANT)), min_size=1, max_size=6))
def test_qualified_targets_select_exactly_the_meant_modules_under_bridge_matching(impl, names):
    assert bridge_matched(impl.qualify_targets(names)) == meant(names)


def test_unknown_entries_raise_listing_every_unmatched_entry_and_the_valid_names(impl):
    with pytest.raises(impl.TargetError) as err:
        impl.qualify_targets(["wq_b", "q_proj", "indexer.wk", "*.layers.9.*"], module_names=MODULE_NAMES)
    msg = str(err.value)
    for entry in ("q_proj", "indexer.wk", "*.layers.9.*"):
        assert repr(entry) in msg, f"unmatched {entry!r} not named in: {msg}"
    assert "'wq_b'" not in msg.split("match no module")[0], msg
    for valid in ("wq_a", "q_b_proj", "indexer.wq_b", "compressor.wkv"):
        assert valid in msg.split("Valid names here:")[1], f"valid name {valid!r} not listed: {msg}"


def test_exclusion_matching_nothing_raises(impl):
    with pytest.raises(impl.TargetError, match="exclusion"):
        impl.qualify_exclusions(["*.layers.7.*"], module_names=MODULE_NAMES)


def test_nested_target_on_a_model_without_it_raises(impl):
    sliding_only = [n for n in MODULE_NAMES if "indexer" not in n and "compressor" not in n]
    with pytest.raises(impl.TargetError, match="indexer.wq_b"):
        impl.qualify_targets(["wq_b", "indexer.wq_b"], module_names=sliding_only)
    assert impl.qualify_targets(["wq_b"], module_names=sliding_only) == ["*.self_attention.wq_b"]


def test_comma_joined_string_is_rejected(impl):
    with pytest.raises(impl.TargetError, match="comma"):
        impl.qualify_exclusions("wq_b,wkv")


def test_a_leaf_of_any_module_is_accepted_as_bridge_accepts_it(impl):
    """A name outside the vocabulary that is the leaf of some module (``linear_fc1``) passes through and is not
    refused: Bridge's matcher takes a leaf equal to the pattern, so the check must too (mutation campaign)."""
    assert impl.qualify_targets(["linear_fc1"], module_names=MODULE_NAMES) == ["linear_fc1"]
    assert impl.qualify_exclusions("output_layer", module_names=MODULE_NAMES) == "output_layer"


@pytest.mark.parametrize("entry", [None, 5, ("wq_b",), ""], ids=["None", "int", "tuple", "empty"])
def test_an_entry_that_is_no_name_is_refused_by_type(impl, entry):
    """A target list holding something other than a non-empty name is a TargetError naming it, with or without the
    model's module names, never a TypeError from deeper down (mutation campaign)."""
    for module_names in (None, MODULE_NAMES):
        with pytest.raises(impl.TargetError, match="non-empty strings"):
            impl.qualify_targets(["wq_a", entry], module_names=module_names)


def test_a_refusal_shows_what_each_name_was_read_as_and_a_wildcard_that_works(impl):
    """What a user needs to fix a target list: each refused vocabulary name with the pattern it was read as (and a
    name passed through without one), and a suggested wildcard that matches a module of this very model when
    pasted back (mutation campaign)."""
    sliding_only = [n for n in MODULE_NAMES if "indexer" not in n and "compressor" not in n]
    with pytest.raises(impl.TargetError) as err:
        impl.qualify_targets(["indexer.wq_b", "q_zz"], module_names=sliding_only)
    msg = str(err.value)
    assert "'indexer.wq_b' (as '*.self_attention.indexer.linear_wq_b')" in msg, msg
    assert "'q_zz' (as" not in msg, msg
    suggested = re.search(r"such as '([^']+)'", msg)
    assert suggested, f"no wildcard suggested: {msg}"
    assert impl.qualify_targets([suggested.group(1)], module_names=sliding_only), msg

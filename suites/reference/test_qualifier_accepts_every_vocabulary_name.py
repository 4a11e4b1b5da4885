"""Checked against a model's module names, the qualifier accepts every name its vocabulary lists, whichever
naming the user writes it in: the transformers (``q_b_proj``) and official (``indexer.wq_b``) names match no
module leaf of the native graph as typed, only as rewritten, and each must still be accepted."""

from __future__ import annotations

import pytest

from fixtures.data.module_tree import ATTENTION_LEAVES

pytestmark = pytest.mark.cpu

SCOPE = "decoder.layers.{i}.self_attention"
# the linears of a native V4 attention block with a CSA compressor and an indexer (the native graph's paths)
NATIVE = ATTENTION_LEAVES
MODULES = tuple(f"{SCOPE.format(i=i)}.{leaf}" for i in range(2) for leaf in NATIVE)
# the names users write (README / transformers / official checkpoint), none of them a native leaf as typed
WRITTEN = {
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_proj": "wkv",
    "o_a_proj": "wo_a",
    "o_b_proj": "wo_b",
    "indexer.wq_b": "indexer.linear_wq_b",
    "compressor.kv_proj": "compressor.wkv",
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_name_in_another_naming_is_accepted_against_the_native_modules(impl, name):
    (qualified,) = impl.qualify_targets([name], module_names=MODULES)
    assert qualified.endswith(f"self_attention.{WRITTEN[name]}"), f"{name!r} was rewritten to {qualified!r}"

"""The qualifier's check of a pattern against a model's modules is Megatron-Bridge's own matching rule: a wildcard
it passes through is accepted exactly where Bridge's ``wildcard_match`` (or its leaf equality) would wrap a module,
including where Bridge's unescaped dots match a character that is not a dot."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cpu

INDEXER = "decoder.layers.0.self_attention.indexer.linear_wq_b"
MAIN = "decoder.layers.0.self_attention.wq_b"
CASES = {
    # '.wq_b' matches 'r_wq_b' under Bridge's rule: the collision the qualifier exists for
    "dot-matches-underscore": ("*.wq_b", (INDEXER,)),
    "plain-wildcard": ("*.layers.0.self_attention.wq_b", (MAIN, INDEXER)),
    "no-match": ("*.layers.1.*", (MAIN, INDEXER)),
    "leaf-equality": ("linear_wq_b", (INDEXER,)),
}


def _bridge_wraps(pattern: str, names) -> bool:
    from megatron.bridge.peft.utils import wildcard_match

    return any(n.rpartition(".")[2] == pattern or wildcard_match(pattern, n) for n in names)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_passed_through_pattern_is_accepted_exactly_where_bridge_matches(impl, case):
    impl.compat_report()  # Megatron-Bridge imports only after the compat layer
    pattern, names = CASES[case]
    expected = _bridge_wraps(pattern, names)
    try:
        impl.qualify_targets([pattern], module_names=names)
        accepted = True
    except impl.TargetError:
        accepted = False
    assert accepted is expected, f"{pattern!r} on {names}: accepted={accepted}, Bridge matches={expected}"

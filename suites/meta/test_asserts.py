"""The assertion helpers fail when they should, and their messages name the tensor, the index and the context."""

from __future__ import annotations

import pytest
import torch

import fixtures.asserts as ah

pytestmark = pytest.mark.cpu


def test_assert_close_passes_within_tolerance():
    ah.assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0 + 1e-7, 2.0]), atol=1e-6, name="logits")
    ah.assert_close(torch.tensor([float("inf")]), torch.tensor([float("inf")]), atol=0, name="inf")
    ah.assert_close(torch.tensor([float("nan")]), torch.tensor([float("nan")]), atol=0, name="nan", equal_nan=True)


def test_assert_close_reports_worst_element_index_dtype_and_context():
    expected = torch.zeros(2, 3, dtype=torch.bfloat16)
    actual = expected.clone()
    actual[0, 1], actual[1, 2] = 0.25, 0.5
    with pytest.raises(AssertionError) as info:
        ah.assert_close(actual, expected, atol=0.1, name="logits", context="rank 1, layer 3")
    assert str(info.value).startswith(
        "logits: max |Δ|=0.5 at index (1, 2) (dtype torch.bfloat16), atol=0.1, rtol=0;"
    ), info.value
    assert "2/6 elements out of tolerance [rank 1, layer 3]" in str(info.value)


def test_assert_close_fails_on_nan_and_shape():
    with pytest.raises(AssertionError, match=r"^h: max \|Δ\|=nan at index \(1,\)"):
        ah.assert_close(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, 1.0]), atol=1.0, name="h")
    with pytest.raises(AssertionError, match=r"^h: shape \(2,\), expected \(3,\)"):
        ah.assert_close(torch.zeros(2), torch.zeros(3), atol=1.0, name="h")


def test_assert_close_rtol_scales_with_expected():
    ah.assert_close(torch.tensor([101.0]), torch.tensor([100.0]), atol=0, rtol=0.011, name="w")
    with pytest.raises(AssertionError, match="^w: max"):
        ah.assert_close(torch.tensor([101.0]), torch.tensor([100.0]), atol=0, rtol=0.009, name="w")


def test_assert_bitwise_equal_sees_signed_zero_and_names_first_index():
    ah.assert_bitwise_equal(torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(2, 3), name="w")
    with pytest.raises(AssertionError) as info:
        ah.assert_bitwise_equal(
            torch.tensor([[1.0, 0.0], [2.0, 3.0]]), torch.tensor([[1.0, -0.0], [2.0, 4.0]]), name="wq_b", context="tp 2"
        )
    assert str(info.value) == (
        "wq_b: not bitwise equal: 2/4 elements differ, first at index (0, 1) (dtype torch.float32): 0.0 vs -0.0 [tp 2]"
    )


def test_assert_bitwise_equal_checks_dtype_and_shape():
    with pytest.raises(AssertionError, match=r"^a: not bitwise equal: dtype torch.float32 vs torch.bfloat16"):
        ah.assert_bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16), name="a")
    with pytest.raises(AssertionError, match=r"^a: not bitwise equal: shape \(2,\) vs \(1, 2\)"):
        ah.assert_bitwise_equal(torch.zeros(2), torch.zeros(1, 2), name="a")


def test_state_dict_comparison_lists_every_difference_at_once():
    a = {"x": torch.zeros(2), "y": torch.ones(2), "only_a": torch.zeros(1), "z": torch.zeros(2)}
    b = {"x": torch.zeros(2), "y": torch.tensor([1.0, 2.0]), "only_b": torch.zeros(1), "z": torch.zeros(3)}
    ah.assert_state_dicts_bitwise_equal({"x": torch.zeros(2)}, {"x": torch.zeros(2)})
    with pytest.raises(AssertionError) as info:
        ah.assert_state_dicts_bitwise_equal(a, b, context="adapter")
    assert str(info.value).splitlines() == [
        "state dicts differ (4 vs 4 entries) [adapter]:",
        "  only in a (1): only_a",
        "  only in b (1): only_b",
        "  y: 1/2 elements differ, first at index (1,) (dtype torch.float32): 1.0 vs 2.0",
        "  z: shape (2,) vs (3,)",
    ]


def test_repro_attaches_a_note_and_reraises():
    with pytest.raises(AssertionError) as info, ah.repro("export_adapter(tp=2, seed=7)"):
        ah.assert_equal(3, 4, what="shards", context="rank 1")
    assert str(info.value) == "shards=3, expected 4 [rank 1]"
    assert info.value.__notes__ == ["repro: export_adapter(tp=2, seed=7)"]


def test_ulp_tolerance_is_units_of_eps_at_the_reference_scale():
    assert ah.ulp_tolerance(torch.float32, ulps=4, scale=2.0) == 4 * torch.finfo(torch.float32).eps * 2.0
    with pytest.raises(ValueError):
        ah.ulp_tolerance(torch.float32, ulps=0, scale=1.0)


def test_assert_close_ulps_scales_with_expected_and_reports_units():
    eps = torch.finfo(torch.float32).eps
    expected = torch.tensor([100.0, -1.0], dtype=torch.float64)
    tol = ah.assert_close_ulps(expected + 3 * eps * 100, expected, dtype=torch.float32, ulps=4, name="logits")
    assert tol == 4 * eps * 100
    with pytest.raises(AssertionError, match=r"logits: .*5\.0 units of eps\(torch\.float32\)\*scale, scale=100"):
        ah.assert_close_ulps(expected + 5 * eps * 100, expected, dtype=torch.float32, ulps=4, name="logits")


def test_assert_effect_exceeds_names_what_could_not_be_detected():
    ah.assert_effect_exceeds(1.0, 1e-3, factor=10, what="adapter")
    with pytest.raises(AssertionError, match=r"adapter: effect 5\.000e-03 is not above 10 x tolerance"):
        ah.assert_effect_exceeds(5e-3, 1e-3, factor=10, what="adapter")


def test_assert_within_ulps_holds_a_measured_difference_to_units_of_eps_at_the_scale():
    eps = torch.finfo(torch.float32).eps
    assert ah.assert_within_ulps(3 * eps * 2.0, dtype=torch.float32, ulps=4, scale=2.0, what="loss") == 4 * eps * 2.0
    with pytest.raises(
        AssertionError, match=r"^loss: .* is 5\.0 units of eps\(torch\.float32\)\*scale, scale=2, .* \[rank 1\]$"
    ):
        ah.assert_within_ulps(5 * eps * 2.0, dtype=torch.float32, ulps=4, scale=2.0, what="loss", context="rank 1")
    with pytest.raises(AssertionError, match="nan"):
        ah.assert_within_ulps(float("nan"), dtype=torch.float32, ulps=4, scale=2.0, what="loss")

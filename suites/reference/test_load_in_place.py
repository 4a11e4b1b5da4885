"""A quantized weight is dequantized straight into its parameter only where Megatron-Bridge's own mapping would
put it there, learned from the mapping, never assumed.

``impl.landing_views(row, mapping, module, param, shapes)`` answers, for one Megatron-Bridge mapping at
tensor-parallel size 1, which view of the parameter each checkpoint input lands in, or None. The specification is
Bridge itself: writing each input into its view must give, bit for bit, the parameter that
``mapping.hf_to_megatron`` returns for the same inputs; a mapping that does more than place its inputs (reorders
elements, transposes, permutes) gets None, so the load takes Bridge's path. The end-to-end values are checked
against an independent dequantizer in ``test_quantized_base.py``; the speed in ``test_bench_load.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from fixtures.data.native_weights import ensure_single_rank_megatron

pytestmark = pytest.mark.cpu

_ROWS = itertools.count()  # each test's probes get keys of their own (the landing cache is per process)


@pytest.fixture
def bridge_mappings(impl):
    ensure_single_rank_megatron(impl)
    from megatron.bridge.models.conversion import param_mapping

    return param_mapping


def _linear(rows: int, cols: int) -> nn.Module:
    module = nn.Linear(cols, rows, bias=False)
    module.tensor_model_parallel = False  # how Bridge's AutoMapping tells a replicated module
    return module


def _write(views: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    for k, view in views.items():
        view.copy_(inputs[k])


def _assert_lands_like_bridge(impl, mapping, module: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    param = module.weight
    shapes = {k: tuple(t.shape) for k, t in inputs.items()}
    views = impl.landing_views(next(_ROWS), mapping, module, param, shapes)
    assert views is not None, f"{type(mapping).__name__}: no landing offered for a mapping that only places inputs"
    for k, view in views.items():
        start = view.data_ptr() - param.data_ptr()
        assert 0 <= start < param.numel() * param.element_size(), f"{k}: view is not inside the parameter"
    with torch.no_grad():
        _write(views, inputs)
    theirs = mapping.hf_to_megatron(inputs[""] if list(inputs) == [""] else inputs, module)
    assert torch.equal(param, theirs), f"{type(mapping).__name__}: in-place values differ from hf_to_megatron's"


def test_gated_mlp_inputs_land_where_bridge_concatenates_them(impl, bridge_mappings):
    gen = torch.Generator().manual_seed(0)
    mapping = bridge_mappings.GatedMLPMapping("fc1.weight", gate="w1.weight", up="w3.weight")
    inputs = {"gate": torch.randn(6, 5, generator=gen), "up": torch.randn(6, 5, generator=gen)}
    _assert_lands_like_bridge(impl, mapping, _linear(12, 5), inputs)


@pytest.mark.parametrize("kind", ["ColumnParallelMapping", "RowParallelMapping", "ReplicatedMapping", "AutoMapping"])
def test_a_single_input_mapping_that_returns_its_input_lands_on_the_whole_parameter(impl, bridge_mappings, kind):
    mapping = getattr(bridge_mappings, kind)("w.weight", "w.weight")
    _assert_lands_like_bridge(impl, mapping, _linear(7, 3), {"": torch.randn(7, 3)})


def test_an_order_bridge_chooses_is_learned_not_assumed(impl, bridge_mappings):
    """A mapping that puts ``up`` first: the probe finds ``up`` at the start of the parameter."""

    class UpFirst(bridge_mappings.GatedMLPMapping):
        def hf_to_megatron(self, hf_weights, megatron_module):
            return torch.cat([hf_weights["up"], hf_weights["gate"]], dim=0)

    mapping = UpFirst("fc1.weight", gate="w1.weight", up="w3.weight")
    module = _linear(8, 4)
    views = impl.landing_views(next(_ROWS), mapping, module, module.weight, {"gate": (4, 4), "up": (4, 4)})
    assert views is not None and views["up"].data_ptr() == module.weight.data_ptr(), "up must land first"
    _assert_lands_like_bridge(impl, mapping, _linear(8, 4), {"gate": torch.randn(4, 4), "up": torch.randn(4, 4)})


def test_a_mapping_that_moves_elements_gets_no_landing(impl, bridge_mappings):
    """Transposed halves, a permuted AutoMapping, Bridge's own [in, out] -> [out, in] transpose: all refused."""

    class TransposedHalves(bridge_mappings.GatedMLPMapping):
        def hf_to_megatron(self, hf_weights, megatron_module):
            return torch.cat([hf_weights["gate"].t(), hf_weights["up"].t()], dim=0)

    gated = _linear(8, 4)
    cases = {
        "transposed halves": (TransposedHalves("fc1.weight", gate="a", up="b"), gated, {"gate": (4, 4), "up": (4, 4)}),
        "permuted auto": (bridge_mappings.AutoMapping("w.weight", "w", permute_dims=(1, 0)), _linear(5, 5), None),
        "row [in, out]": (bridge_mappings.RowParallelMapping("w.weight", "w.weight"), _linear(6, 2), {"": (2, 6)}),
    }  # fmt: skip
    for what, (mapping, module, shapes) in cases.items():
        shapes = shapes or {"": tuple(module.weight.shape)}
        views = impl.landing_views(next(_ROWS), mapping, module, module.weight, shapes)
        assert views is None, f"{what}: offered a landing although Bridge moves elements"


def test_bridge_is_asked_once_per_row_and_shape(impl, bridge_mappings):
    calls = []

    class Counting(bridge_mappings.GatedMLPMapping):
        def hf_to_megatron(self, hf_weights, megatron_module):
            calls.append(1)
            return super().hf_to_megatron(hf_weights, megatron_module)

    row, shapes = next(_ROWS), {"gate": (3, 2), "up": (3, 2)}
    for _ in range(3):
        module = _linear(6, 2)
        assert impl.landing_views(row, Counting("f", gate="a", up="b"), module, module.weight, shapes) is not None
    assert len(calls) == 1, f"probe ran {len(calls)} times for one row and shape"
    module = _linear(6, 2)
    impl.landing_views(next(_ROWS), Counting("f", gate="a", up="b"), module, module.weight, shapes)
    assert len(calls) == 2, "another row must be probed on its own"


def test_a_sharded_or_strided_parameter_gets_no_landing(impl, bridge_mappings):
    """Only a plain contiguous tensor can take a view per input: a DTensor (FSDP) or a strided parameter goes
    through Bridge, which knows how to place into it."""
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate

    mapping = bridge_mappings.ColumnParallelMapping("w.weight", "w.weight")
    module = _linear(4, 6)
    strided = nn.Parameter(torch.zeros(6, 4).t())
    assert impl.landing_views(next(_ROWS), mapping, module, strided, {"": (4, 6)}) is None, "strided parameter"
    mesh = DeviceMesh("cpu", [0])
    sharded = nn.Parameter(DTensor.from_local(torch.zeros(4, 6), mesh, [Replicate()]))
    assert impl.landing_views(next(_ROWS), mapping, module, sharded, {"": (4, 6)}) is None, "DTensor parameter"

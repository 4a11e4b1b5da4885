"""An adapter named in the upstream Megatron-Core layout (Megatron-Bridge LoRA naming: ``<module>.adapter.linear_in``
/ ``linear_out``) exports to every dialect exactly like the same adapter named in the Miles layout.

The upstream module names are written here from Megatron-Bridge's DeepSeekV4Bridge registry (0.5.x / 0.6.x:
``wq_a`` <-> ``linear_q_down_proj``, ``wq_b`` <-> ``linear_q_up_proj``, ``wkv`` <-> ``linear_kv_proj``, ``wo_b`` <->
``linear_proj``). ``wo_a`` is ``linear_o_group_proj``, a raw ``nn.Parameter`` upstream that Bridge's LoRA cannot wrap,
so no upstream adapter holds it.
"""

import json
import struct
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu

# Miles leaf -> upstream module under self_attention (the four targets an upstream LoRA can hold)
UPSTREAM_LEAF = {
    "wq_a": "linear_q_down_proj",
    "wq_b": "linear_q_up_proj",
    "wkv": "linear_kv_proj",
    "wo_b": "linear_proj",
}
SHAPES = {"wq_a": (16, 32), "wq_b": (24, 16), "wkv": (8, 32), "wo_b": (32, 12)}  # (out, in)
R = 4
FILES = ("adapter_model.safetensors", "adapter_config.json")


def _layer_prefix(layer: int | None) -> str:
    return "mtp.layers.0.mtp_model_layer" if layer is None else f"decoder.layers.{layer}"


def _twin_states(impl, layers: tuple[int | None, ...]):
    """The same random adapter twice: Miles names, upstream names."""
    gen = torch.Generator().manual_seed(17)
    miles, upstream = {}, {}
    for layer in layers:
        for leaf, (out_f, in_f) in SHAPES.items():
            a, b = torch.randn(R, in_f, generator=gen), torch.randn(out_f, R, generator=gen)
            for tensors, module in ((miles, leaf), (upstream, UPSTREAM_LEAF[leaf])):
                stem = f"{_layer_prefix(layer)}.self_attention.{module}.adapter"
                tensors[f"{stem}.linear_in.weight"], tensors[f"{stem}.linear_out.weight"] = a, b
    return impl.AdapterState(miles, r=R, alpha=8.0), impl.AdapterState(upstream, r=R, alpha=8.0)


def _export(impl, state, out: Path, dialect: str) -> dict[str, object]:
    """What an export wrote: the config's bytes; the safetensors header (parsed: safetensors serializes its metadata
    map in hash order, so two exports of one adapter can differ in key order alone) and data bytes."""
    impl.export_adapter(state, out, dialect=dialect, base_model_name_or_path="tiny-base")
    raw = (out / FILES[0]).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return {
        "header": json.loads(raw[8 : 8 + size]),
        "tensor bytes": raw[8 + size :],
        FILES[1]: (out / FILES[1]).read_bytes(),
    }


@pytest.mark.parametrize(
    ("dialect", "layers"),
    [("transformers", (0, 1, 2)), ("sglang", (0, 1, 2)), ("official", (0, 1, 2, None))],
    ids=["transformers", "sglang", "official-with-mtp"],
)
def test_an_upstream_named_adapter_exports_exactly_like_its_miles_twin(impl, tmp_path, dialect, layers):
    miles, upstream = _twin_states(impl, layers)
    want = _export(impl, miles, tmp_path / "miles", dialect)
    got = _export(impl, upstream, tmp_path / "upstream", dialect)
    for part, value in want.items():
        assert got[part] == value, f"{dialect}: {part} differs between the upstream-named and the Miles-named adapter"


def test_the_in_memory_publication_is_the_same_too(impl):
    miles, upstream = _twin_states(impl, (0, 3))
    want_tensors, want_config = impl.publish_in_memory(miles)
    got_tensors, got_config = impl.publish_in_memory(upstream)
    assert got_config == want_config
    assert list(got_tensors) == list(want_tensors), sorted(set(got_tensors) ^ set(want_tensors))
    for name, t in want_tensors.items():
        assert torch.equal(got_tensors[name], t), f"{name} differs"


def test_an_upstream_adapter_on_the_grouped_wo_a_parameter_is_refused_with_the_reason(impl):
    stem = "decoder.layers.0.self_attention.linear_o_group_proj.adapter"
    state = impl.AdapterState(
        {f"{stem}.linear_in.weight": torch.zeros(R, 12), f"{stem}.linear_out.weight": torch.zeros(16, R)}, r=R, alpha=8
    )
    with pytest.raises(impl.UpstreamAdapterError, match=r"linear_o_group_proj.*raw nn\.Parameter"):
        impl.publish_in_memory(state)


def test_one_state_naming_a_module_in_both_layouts_is_refused(impl):
    miles, upstream = _twin_states(impl, (0,))
    mixed = dict(miles.tensors)
    stem = "decoder.layers.0.self_attention.linear_q_up_proj.adapter"
    mixed[f"{stem}.linear_in.weight"] = upstream.tensors[f"{stem}.linear_in.weight"]
    with pytest.raises(impl.ExportError, match="same adapter tensor"):
        impl.publish_in_memory(impl.AdapterState(mixed, r=R, alpha=8.0))


def test_an_upstream_indexer_adapter_is_not_mistaken_for_the_main_wq_b(impl):
    """``core_attention.indexer.linear_wq_b`` is the indexer's projection in both layouts: not exportable."""
    stem = "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.adapter"
    state = impl.AdapterState(
        {f"{stem}.linear_in.weight": torch.zeros(R, 16), f"{stem}.linear_out.weight": torch.zeros(8, R)}, r=R, alpha=8
    )
    with pytest.raises(
        impl.ExportError, match=r"not (a native V4 attention LoRA parameter|one of the exportable)"
    ) as info:
        impl.publish_in_memory(state)
    assert f"{stem}.linear_in.weight" in str(info.value), f"the error does not name the tensor: {info.value}"

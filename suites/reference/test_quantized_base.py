"""Quantized official checkpoints (FP8 E4M3 + 128x128 UE8M0 / F32 scales, MXFP4 routed experts) load exactly:
dequantized values equal Megatron-Bridge's dequantizer bit for bit, and malformed quantization is a typed error."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import fixtures.asserts as ah
from fixtures.data.native_weights import ensure_single_rank_megatron
from fixtures.ranks.bridge_rank_fns import RoundTripCase, rank_bridge_roundtrip
from fixtures.runner.multirank import impl_preload, run_ranks
from tiny_models.quantize import dequantize_state, quant_config, write_quantized_checkpoint

pytestmark = pytest.mark.cpu

VARIANTS = {"instruct-ue8m0-mxfp4": ("ue8m0", "mxfp4"), "base-f32-fp8": ("fp32", "fp8")}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def quantized(request, tmp_path_factory):
    scale_dtype, experts = VARIANTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    write_quantized_checkpoint(None, out, seed=5, scale_dtype=scale_dtype, experts=experts)
    return request.param, out, load_file(str(out / "model.safetensors"))


def test_checkpoint_has_multi_block_scales_and_the_requested_formats(quantized):
    """Guard against a vacuous fixture: several 128x128 blocks (some partial), MXFP4 or FP8 experts as asked."""
    variant, _, state = quantized
    scales = {n: t for n, t in state.items() if n.endswith(".scale")}
    assert any(t.shape[0] > 1 and t.shape[1] > 1 for n, t in scales.items() if ".experts." not in n), variant
    want_scale = torch.float8_e8m0fnu if variant.startswith("instruct") else torch.float32
    assert {t.dtype for n, t in scales.items() if ".ffn.experts." not in n} == {want_scale}, variant
    expert = state["layers.0.ffn.experts.1.w2.weight"]
    assert expert.dtype == (torch.int8 if "mxfp4" in variant else torch.float8_e4m3fn), f"{variant}: {expert.dtype}"
    if want_scale == torch.float8_e8m0fnu:
        s = torch.cat([t.float().flatten() for t in scales.values()])
        assert torch.equal(s, torch.exp2(torch.log2(s).round())), f"{variant}: UE8M0 scales must be powers of two"


def test_reference_dequantization_equals_megatron_bridges_dequantizer(impl, quantized):
    # megatron.bridge imports only after impl's CPU compat layer (the impl fixture) is installed
    from megatron.bridge.models.conversion.quantization_utils import maybe_dequantize_hf_quantized_weight

    variant, _, state = quantized
    reference = dequantize_state(state)
    quantized_names = [n for n, t in state.items() if t.dtype in (torch.float8_e4m3fn, torch.int8)]
    assert quantized_names, f"{variant}: nothing quantized"
    for name in quantized_names:
        theirs = maybe_dequantize_hf_quantized_weight(name, state, dtype=torch.float32)
        ah.assert_bitwise_equal(
            theirs,
            reference[name],
            name=f"{name} ({state[name].dtype}) dequantized by Megatron-Bridge",
            context=variant,
        )


def test_megatron_bridges_own_loader_reads_quantized_weights_dequantized_through_our_bridge(impl, quantized):
    """Bridge's loader (AutoBridge's path where no upstream V4 bridge is registered) asks the bridge for each loaded
    weight: ours hands it dequantized, equal to the independent dequantization in the float dtype Bridge reads it in,
    never the raw FP8 / MXFP4 bytes."""
    variant, _, state = quantized
    reference = dequantize_state(state)
    bridge = impl.DeepseekV4ConversionBridge()
    names = [n for n, t in state.items() if t.dtype in (torch.float8_e4m3fn, torch.int8)][:4]
    for name in names:
        got = bridge.maybe_modify_loaded_hf_weight(name, state)
        assert got.is_floating_point() and got.dtype.itemsize >= 2, f"{variant}: {name} loaded raw, as {got.dtype}"
        ah.assert_bitwise_equal(got, reference[name].to(got.dtype), name=name, context=variant)
    pair = {"a": names[0], "b": names[1]}
    got = bridge.maybe_modify_loaded_hf_weight(pair, state)
    for key, name in pair.items():
        want = reference[name].to(got[key].dtype)
        ah.assert_bitwise_equal(got[key], want, name=name, context=f"{variant}, a pair")


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_sharded_load_equals_the_dequantized_values_on_every_rank(impl, quantized, layout):
    """TP splits go through Megatron-Bridge's scatter, unsplit weights are dequantized in place: same values."""
    variant, ckpt, _ = quantized
    case = RoundTripCase(impl_name=impl.name, ckpt_dir=str(ckpt), quantized=True, **layout)
    for r in run_ranks(rank_bridge_roundtrip, case, nproc=2, timeout_s=120, preload=impl_preload(impl.name)):
        assert not r.payload["mismatches"], f"{variant} {layout} rank {r.rank}:\n  " + "\n  ".join(
            r.payload["mismatches"][:20]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loaded_native_weights_equal_the_dequantized_values(impl, quantized, dtype):
    """In the model's dtype: Megatron-Bridge's fp32 product cast once (the reference, cast)."""
    variant, ckpt, state = quantized
    variant = f"{variant} {dtype}"
    model = impl.DeepseekV4NativeModel(impl.V4Config.from_hf(quant_config()), include_mtp=True, params_dtype=dtype)
    report = impl.load_official_checkpoint([model], ckpt)
    scales = {n for n in state if n.endswith(".scale")}
    assert scales <= set(report.declared_not_loaded), (
        f"{variant}: scales not declared consumed: {scales - set(report.declared_not_loaded)}"
    )
    reference = dequantize_state(state)
    exported = impl.export_official_state([model])
    assert set(exported) == set(reference), f"{variant}: export names differ: {set(exported) ^ set(reference)}"
    for name, want in reference.items():
        want = want.to(exported[name].dtype) if want.is_floating_point() else want
        ah.assert_bitwise_equal(
            exported[name], want, name=f"native value of {name} vs the dequantized one", context=variant
        )
    # And directly on native parameters: the fused expert fc1 is cat(w1, w3) of the dequantized halves.
    params = dict(model.named_parameters())
    fc1 = params["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    want = torch.cat([reference["layers.1.ffn.experts.2.w1.weight"], reference["layers.1.ffn.experts.2.w3.weight"]])
    assert torch.equal(fc1, want.to(dtype)), f"{variant}: layers.1 expert 2 linear_fc1 != cat(dequant w1, dequant w3)"
    wo_a = reference["layers.0.attn.wo_a.weight"].to(dtype)
    assert torch.equal(params["decoder.layers.0.self_attention.wo_a.weight"], wo_a), f"{variant}: wo_a"


def _rewrite(state: dict, tmp_path, edit) -> None:
    tensors = dict(state)
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")


BAD = {
    "fp8-scale-shape": (
        lambda t: t.update({"layers.0.attn.wq_b.scale": t["layers.0.attn.wq_b.scale"][:1, :1]}),
        "layers.0.attn.wq_b.scale",
    ),
    "expert-scale-shape": (
        lambda t: t.update(
            {"layers.1.ffn.experts.2.w2.scale": torch.cat([t["layers.1.ffn.experts.2.w2.scale"]] * 2, dim=1)}
        ),
        "layers.1.ffn.experts.2.w2.scale",
    ),
    "scale-dtype": (
        lambda t: t.update({"layers.0.attn.wo_a.scale": t["layers.0.attn.wo_a.scale"].float().bfloat16()}),
        "layers.0.attn.wo_a.scale",
    ),
    "weight-dtype-e5m2": (
        lambda t: t.update({"layers.0.attn.wkv.weight": t["layers.0.attn.wkv.weight"].float().to(torch.float8_e5m2)}),
        "layers.0.attn.wkv.weight",
    ),
    "missing-fp8-scale": (
        lambda t: t.pop("layers.1.ffn.shared_experts.w2.scale"),
        "layers.1.ffn.shared_experts.w2.weight",
    ),
    "missing-expert-scale": (lambda t: t.pop("layers.0.ffn.experts.0.w1.scale"), "layers.0.ffn.experts.0.w1.weight"),
    "scale-of-unquantized-weight": (
        lambda t: t.update({"layers.0.attn.compressor.wkv.scale": torch.ones(1, 1)}),
        "layers.0.attn.compressor.wkv.scale",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_malformed_quantization_is_a_typed_error_naming_the_tensor(impl, quantized, tmp_path, kind):
    variant, _, state = quantized
    edit, culprit = BAD[kind]
    _rewrite(state, tmp_path, edit)
    model = impl.DeepseekV4NativeModel(impl.V4Config.from_hf(quant_config()), include_mtp=True)
    with pytest.raises(impl.QuantizationError) as err:
        impl.load_official_checkpoint([model], tmp_path)
    assert culprit in str(err.value), f"{variant}/{kind}: error does not name {culprit}: {err.value}"
    assert isinstance(err.value, impl.Dsv4Error)


# --------------------------------------------------------------------------------------------------
# merged export from a quantized base: exact (fp32 merge, one cast) or refused; the adapter path never asks for it

FIVE = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
LORA_R, LORA_ALPHA = 4, 8


def _lora_on_quantized(impl, quantized):
    """The quantized base loaded into a native model with LoRA on the five targets and non-zero adapters (a plain
    call, not a fixture: under a pin that cannot dequantize, the load must fail inside the test, where the
    xfails file can mark it)."""
    ensure_single_rank_megatron(impl)
    variant, ckpt, state = quantized
    model = impl.DeepseekV4NativeModel(impl.V4Config.from_hf(quant_config()), include_mtp=False)
    impl.load_official_checkpoint([model], ckpt)
    handle = impl.apply_lora([model], targets=list(FIVE), rank=LORA_R, alpha=LORA_ALPHA)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".adapter." in name:  # lora_B starts at zero: make every delta real
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.05)
    return variant, state, model, handle


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float32], ids=["base-dtype", "bfloat16", "float32"])
def test_merged_export_from_a_quantized_base_is_the_fp32_merge_cast_once(impl, quantized, out_dtype):
    """Each targeted weight == (dequant(W) + (alpha/r) B@A) in fp32, cast once (to the base dtype, or the requested
    one: a bf16 merge rounds W, the delta and their sum, one cast rounds once); every other tensor is untouched."""
    variant, state, model, handle = _lora_on_quantized(impl, quantized)
    reference = {n: t for n, t in dequantize_state(state).items() if not n.startswith("mtp.")}
    params = dict(model.named_parameters())
    merged = impl.export_merged_state([model], handle, dtype=out_dtype)
    assert set(merged) == set(reference), f"{variant}: merged export names differ: {set(merged) ^ set(reference)}"
    n_layers = quant_config().num_hidden_layers
    targeted = set()
    for layer in range(n_layers):
        for leaf in FIVE:
            off = f"layers.{layer}.attn.{leaf}.weight"
            stem = f"decoder.layers.{layer}.self_attention.{leaf}"
            a, b = params[f"{stem}.adapter.linear_in.weight"], params[f"{stem}.adapter.linear_out.weight"]
            out = out_dtype or params[f"{stem}.to_wrap.weight"].dtype
            want = (reference[off].float() + (LORA_ALPHA / LORA_R) * (b.float() @ a.float())).to(out)
            assert not torch.equal(want, reference[off].to(out)), f"{variant}: {off}: the delta is zero"
            ah.assert_bitwise_equal(
                merged[off], want, name=f"merged {off} vs the fp32 merge of the dequantized base", context=variant
            )
            targeted.add(off)
    for name in set(reference) - targeted:
        want = reference[name]
        want = want.to(merged[name].dtype) if want.is_floating_point() else want
        ah.assert_bitwise_equal(merged[name], want, name=f"untargeted {name} in the merged export", context=variant)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8], ids=str)
def test_merged_export_into_a_quantized_format_is_refused_with_a_clear_error(impl, quantized, dtype):
    variant, _, model, handle = _lora_on_quantized(impl, quantized)
    with pytest.raises(impl.QuantizationError) as err:
        impl.export_merged_state([model], handle, dtype=dtype)
    msg = str(err.value)
    assert str(dtype).removeprefix("torch.") in msg and "re-quantiz" in msg and "adapter" in msg, f"{variant}: {msg}"


def _trap_every_base_export(impl, monkeypatch) -> list[str]:
    """Replace every route by which code can export a base weight with a trap that records its name and raises:
    the implementation's whole-model exports (where they are defined and where the package re-exports them),
    Megatron-Bridge's model-level exports and the ``megatron_to_hf`` of every Megatron-Bridge parameter mapping
    (each base tensor leaves through one). The list records calls even where the caller swallows the error."""
    import sys

    from megatron.bridge.models.conversion import auto_bridge, model_bridge, param_mapping

    calls: list[str] = []

    def trap(name):
        def raise_(*_args, **_kwargs):
            calls.append(name)
            raise AssertionError(f"the adapter export path exported a base weight through {name}")

        return raise_

    mappings, seen = [param_mapping.MegatronParamMapping], set()
    while mappings:
        cls = mappings.pop()
        if cls not in seen:
            seen.add(cls)
            mappings.extend(cls.__subclasses__())
            if "megatron_to_hf" in vars(cls):
                monkeypatch.setattr(cls, "megatron_to_hf", trap(f"{cls.__name__}.megatron_to_hf"))
    for owner, names in (
        (model_bridge.MegatronModelBridge, ("stream_weights_megatron_to_hf", "stream_weights_megatron_to_hf_quant")),
        (model_bridge, ("stream_weights_megatron_to_hf", "stream_weights_megatron_to_hf_quant")),
        (
            auto_bridge.AutoBridge,
            ("export_hf_weights", "export_hf_weights_quant", "save_hf_pretrained", "save_hf_weights"),
        ),
    ):
        for name in names:
            if hasattr(owner, name):  # older pins lack some of them
                monkeypatch.setattr(owner, name, trap(f"{getattr(owner, '__name__', owner)}.{name}"))
    for name in ("export_official_state", "export_merged_state"):
        defined_in = sys.modules[getattr(impl, name).__module__]
        for module in {defined_in, impl.module}:
            monkeypatch.setattr(module, name, trap(f"{impl.name}.{name}"))
    return calls


def test_adapter_export_never_requests_a_base_export(impl, quantized, tmp_path, monkeypatch):
    """The portable path is adapter-only: with every base-weight export trapped (``_trap_every_base_export``),
    gathering and exporting the adapter still succeed, ask no trap for anything, and publish LoRA halves only."""
    variant, _, model, handle = _lora_on_quantized(impl, quantized)
    official_export = impl.export_official_state  # the untrapped function: proves the mapping traps are live
    calls = _trap_every_base_export(impl, monkeypatch)
    with pytest.raises(AssertionError, match="exported a base weight"):
        official_export([model])
    with pytest.raises(AssertionError, match="exported a base weight"):
        impl.export_merged_state([model], handle)
    assert any(c.endswith(".megatron_to_hf") for c in calls) and f"{impl.name}.export_merged_state" in calls, calls
    calls.clear()
    adapter = impl.gather_adapter_state([model], handle)
    out = tmp_path / "adapter"
    impl.export_adapter(adapter, out, base_model_name_or_path=str(tmp_path))
    assert not calls, f"{variant}: the adapter export asked for a base export (error swallowed or not): {calls}"
    assert (out / "adapter_model.safetensors").is_file() and (out / impl.COMPLETE_MARKER).is_file(), variant
    published = load_file(str(out / "adapter_model.safetensors"))
    not_lora = [n for n in published if not n.endswith((".lora_A.weight", ".lora_B.weight"))]
    assert published and not not_lora, f"{variant}: the adapter file holds tensors that are no LoRA half: {not_lora}"

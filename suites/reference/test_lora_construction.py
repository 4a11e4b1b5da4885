"""LoRA construction on the native V4 graph: exactly the meant modules are wrapped, only adapters train.

The model tree is the real native model (``DeepseekV4NativeModel``) of the tiny-mixed preset or of a
hypothesis-generated config; the expected wrapped set is computed here from that tree with plain string rules,
never from the code under test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch import nn

from fixtures.data.native_weights import ensure_single_rank_megatron
from fixtures.data.strategies import v4_configs
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

# user name -> native path under self_attention (the spec, written out)
MEANT = {
    "wq_a": "wq_a",
    "q_b_proj": "wq_b",
    "wq_b": "wq_b",
    "kv_proj": "wkv",
    "wo_a": "wo_a",
    "o_b_proj": "wo_b",
    "indexer.wq_b": "indexer.linear_wq_b",
    "indexer.weights_proj": "indexer.linear_weights_proj",
    "compressor.wkv": "compressor.wkv",
    "indexer.compressor.wgate": "indexer.compressor.wgate",
}


@pytest.fixture(scope="module")
def megatron_world(impl) -> None:
    ensure_single_rank_megatron(impl)


def _tree(impl, hf_config=None) -> nn.Module:
    cfg = impl.V4Config.from_hf(hf_config if hf_config is not None else get_preset("tiny-mixed"))
    return impl.DeepseekV4NativeModel(cfg, include_mtp=False)


def _expected(root: nn.Module, targets: list[str], excluded_layers: set[int]) -> set[str]:
    names = {n for n, _ in root.named_modules()}
    return {
        f"decoder.layers.{i}.self_attention.{MEANT[t]}"
        for t in targets
        for i in range(len(root.decoder.layers))
        if i not in excluded_layers and f"decoder.layers.{i}.self_attention.{MEANT[t]}" in names
    }


def _wrapped(root: nn.Module) -> set[str]:
    return {n for n, m in root.named_modules() if hasattr(m, "adapter") and hasattr(m, "to_wrap")}


def _holders(root: nn.Module, target: str) -> list[int]:
    """The layers whose attention has the native module ``target`` means (plain string rules on the tree)."""
    names = {n for n, _ in root.named_modules()}
    return [i for i in range(len(root.decoder.layers)) if f"decoder.layers.{i}.self_attention.{MEANT[target]}" in names]


@st.composite
def _wrappable_choice(draw: st.DrawFn, root: nn.Module) -> tuple[list[str], set[int]]:
    """Targets every one of which some layer has, and excluded layers (any of the real range) that leave at
    least one layer holding a target: a choice that must wrap something."""
    reachable = [t for t in sorted(MEANT) if _holders(root, t)]
    targets = draw(st.lists(st.sampled_from(reachable), min_size=1, max_size=5, unique=True), label="targets")
    holding = sorted({i for t in targets for i in _holders(root, t)})
    keep = draw(st.sampled_from(holding), label="kept layer")
    others = [i for i in range(len(root.decoder.layers)) if i != keep]
    excluded = draw(st.sets(st.sampled_from(others), max_size=len(others)), label="excluded") if others else set()
    return targets, excluded


#: how many examples reached each outcome (printed under ``-s``; the positive test asserts its own share)
OUTCOMES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_outcomes():
    yield
    print("\nLoRA construction outcomes (examples per path):", dict(sorted(OUTCOMES.items())))


@given(spec=v4_configs(), data=st.data())
def test_wrapped_modules_are_exactly_the_meant_ones(impl, megatron_world, spec, data):
    root = _tree(impl, spec.to_config())
    targets, excluded = data.draw(_wrappable_choice(root), label="targets, excluded")
    expected = _expected(root, targets, excluded)
    exclude = [f"*.layers.{i}.*" for i in sorted(excluded)]
    assert expected, f"the strategy drew a choice that wraps nothing: targets={targets} exclude={exclude}"
    impl.apply_lora([root], targets=targets, exclude=exclude, rank=2, alpha=4)
    OUTCOMES["wrapped exactly the meant modules"] += 1
    event("wrapped exactly the meant modules")
    assert _wrapped(root) == expected, f"targets={targets} exclude={exclude}"


_FAULTS = ("a target no layer has", "an excluded layer the model lacks", "exclusions that remove every module")


@given(spec=v4_configs(), fault=st.sampled_from(_FAULTS), data=st.data())
def test_targets_or_exclusions_that_match_nothing_raise_naming_them(impl, megatron_world, spec, fault, data):
    """A target or an exclusion that matches no module is a typed error naming it; so is a choice that leaves
    nothing to wrap."""
    root = _tree(impl, spec.to_config())
    n_layers = len(root.decoder.layers)
    targets, excluded = data.draw(_wrappable_choice(root), label="targets, excluded")
    unreachable = [t for t in sorted(MEANT) if not _holders(root, t)]
    if fault == _FAULTS[0] and not unreachable:  # every target exists in this tree: the next fault instead
        fault = _FAULTS[1]
    if fault == _FAULTS[0]:
        offender = data.draw(st.sampled_from(unreachable), label="unreachable target")
        targets, offenders = [*targets, offender], [repr(offender)]
    elif fault == _FAULTS[1]:
        absent = data.draw(st.integers(n_layers, n_layers + 3), label="absent layer")
        excluded, offenders = {*excluded, absent}, [repr(f"*.layers.{absent}.*")]
    else:
        excluded, offenders = {i for t in targets for i in _holders(root, t)}, []
    exclude = [f"*.layers.{i}.*" for i in sorted(excluded)]
    OUTCOMES[f"raised: {fault}"] += 1
    event(f"raised: {fault}")
    with pytest.raises(impl.TargetError) as info:
        impl.apply_lora([root], targets=targets, exclude=exclude, rank=2, alpha=4)
    if offenders:
        assert any(o in str(info.value) for o in offenders), f"{info.value} names none of {offenders} ({fault})"
    else:
        assert "remove every module" in str(info.value), f"{info.value} ({fault}: targets={targets})"
    assert not _wrapped(root), f"{fault}: modules wrapped despite the error: {sorted(_wrapped(root))}"


@pytest.mark.parametrize("name", ["wq_b", "wkv"])
def test_a_bare_name_never_wraps_a_nested_module(impl, megatron_world, name):
    """Bare ``wq_b`` wraps the main projection, not the indexer's; bare ``wkv`` neither compressor's ``wkv``."""
    root = _tree(impl)
    nested = [
        n
        for n, _ in root.named_modules()
        if ".self_attention." in n and n.endswith(("indexer.linear_wq_b", ".compressor.wkv"))
    ]
    assert nested, "the tiny preset must have indexer/compressor projections for this test to mean anything"
    impl.apply_lora([root], targets=[name], rank=2, alpha=4)
    wrapped = _wrapped(root)
    assert wrapped and all(n.endswith(f".self_attention.{name}") for n in wrapped), sorted(wrapped)


def test_unknown_targets_raise_listing_valid_names(impl, megatron_world):
    with pytest.raises(impl.TargetError, match=r"'q_proj'.*Valid names here: wq_a, q_a_proj"):
        impl.apply_lora([_tree(impl)], targets=["wq_b", "q_proj"], rank=2, alpha=4)


def test_non_linear_target_is_rejected(impl, megatron_world):
    with pytest.raises(impl.TargetError, match="q_norm"):
        impl.apply_lora([_tree(impl)], targets=["*.self_attention.q_norm"], rank=2, alpha=4)


def test_only_adapter_params_are_trainable_and_recorded_to_save(impl, megatron_world):
    root = _tree(impl)
    handle = impl.apply_lora([root], targets=["wq_a", "wq_b", "wkv", "wo_a", "wo_b"], rank=2, alpha=4)
    trainable = {n for n, p in root.named_parameters() if p.requires_grad}
    assert trainable and all(".adapter.linear_" in n for n in trainable), sorted(trainable)
    assert set(handle.params_to_save) == trainable
    assert len(trainable) == 2 * len(_wrapped(root))


def test_multi_lora_is_rejected(impl, megatron_world):
    with pytest.raises(impl.MultiLoRAUnsupportedError):
        impl.apply_lora([_tree(impl)], targets=["wq_b"], rank=2, alpha=4, adapter_names=["a", "b"])
    root = _tree(impl)
    impl.apply_lora([root], targets=["wq_b"], rank=2, alpha=4)
    with pytest.raises(impl.MultiLoRAUnsupportedError, match="already carries adapters"):
        impl.apply_lora([root], targets=["wkv"], rank=2, alpha=4)


def test_optimizer_steps_update_every_adapter_and_no_base_parameter(impl, megatron_world):
    torch.manual_seed(0)
    root = _tree(impl)
    # the five main targets: the indexer only selects top-k entries (no gradient path from the LM loss)
    impl.apply_lora(
        [root],
        targets=["wq_a", "wq_b", "wkv", "wo_a", "wo_b"],
        rank=2,
        alpha=4,
        lora_B_init_method="normal",
    )
    base = {n: p.detach().clone() for n, p in root.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in root.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam([p for p in root.parameters() if p.requires_grad], lr=1e-2)
    d = root.decoder.layers[0].self_attention.v4.hidden_size
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, 16, d, generator=gen), torch.randn(2, 16, d, generator=gen)
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    for step in range(3):
        h = x
        for layer in root.decoder.layers:
            h = h + layer.self_attention(h, positions)
        loss = (h - target).pow(2).mean()
        assert torch.isfinite(loss), f"step {step}: loss {loss}"
        opt.zero_grad()
        loss.backward()
        opt.step()
    for n, p in root.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"base parameter {n} changed"
        else:
            assert torch.isfinite(p).all() and not torch.equal(p, adapters[n]), f"adapter {n} did not update"


@pytest.mark.parametrize("names", [["default"], []], ids=["one-name", "no-name"])
def test_one_named_adapter_or_none_is_accepted(impl, megatron_world, names):
    root = _tree(impl)
    impl.apply_lora([root], targets=["wq_b"], rank=2, alpha=4, adapter_names=names)
    assert _wrapped(root), f"adapter_names={names}: nothing was wrapped"


def test_every_chunk_is_left_in_training_mode_even_one_lora_selects_nothing_in(impl, megatron_world):
    cfg = impl.V4Config.from_hf(get_preset("tiny-mixed"))
    chunks = [impl.DeepseekV4NativeModel(cfg, layer_numbers=numbers, include_mtp=False) for numbers in ([0, 1], [2, 3])]
    for chunk in chunks:
        chunk.eval()
    handle = impl.apply_lora(chunks, targets=["wq_a"], exclude=["*.layers.2.*", "*.layers.3.*"], rank=2, alpha=4)
    assert handle.wrapped[1] == [], f"chunk 1 (layers 2-3, all excluded) wrapped {handle.wrapped[1]}"
    for c, chunk in enumerate(chunks):
        eval_mode = sorted(n for n, m in chunk.named_modules() if not m.training)
        assert not eval_mode, f"chunk {c}: modules left in eval mode after apply_lora: {eval_mode[:4]}"
    trainable = [n for n, p in chunks[1].named_parameters() if p.requires_grad]
    assert not trainable, f"chunk 1 (nothing selected): parameters left trainable: {trainable[:4]}"


@pytest.mark.parametrize("kind", ["target", "exclusion"])
def test_an_entry_matching_no_module_is_reported_as_what_it_is(impl, megatron_world, kind):
    """A target and an exclusion that both pass the vocabulary but match no module are named as a target and an
    exclusion respectively, so the user knows which list to fix."""
    absent = "*.layers.9.self_attention.wq_a"
    targets, exclude = ([absent, "wq_a"], None) if kind == "target" else (["wq_a"], [absent])
    with pytest.raises(impl.TargetError) as err:
        impl.apply_lora([_tree(impl)], targets=targets, exclude=exclude, rank=2, alpha=4)
    msg = str(err.value)
    assert f"LoRA {kind}(s) {absent!r} match no module" in msg and f"Fix the {kind} list" in msg, f"{kind}: {msg}"


def test_a_layer_wildcard_wraps_that_layers_linears_and_no_norm(impl, megatron_world):
    """``*.layers.0.*`` means every linear of layer 0: the five main projections are wrapped, norms and other
    layers are left alone, and nothing is refused for matching a non-linear module."""
    root = _tree(impl)
    impl.apply_lora([root], targets=["*.layers.0.*"], rank=2, alpha=4)
    wrapped = _wrapped(root)
    main = {f"decoder.layers.0.self_attention.{leaf}" for leaf in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
    assert main <= wrapped, f"*.layers.0.*: main projections not wrapped: {sorted(main - wrapped)}"
    stray = sorted(n for n in wrapped if not n.startswith("decoder.layers.0.") or n.endswith("norm"))
    assert not stray, f"*.layers.0.*: wrapped outside layer 0's linears: {stray}"

"""LoRA on the grouped ``wo_a`` (Miles #2771 semantics): PEFT-flattened factors applied block-diagonally per group.

``z_g = x_g @ (W_g + s * (B @ A)_g)^T`` with ``(B @ A)_g`` = rows ``[g*R, (g+1)*R)``. The base is a real Megatron
``ColumnParallelLinear`` wrapped by the implementation's LoRA (Megatron-Bridge ``LoRA``); the reference is plain
torch on the effective weight, computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fixtures.asserts as ah
from fixtures.data.native_weights import ensure_single_rank_megatron
from fixtures.runner.impl_loader import load_impl
from fixtures.runner.multirank import impl_preload, init_megatron_parallel, run_ranks

pytestmark = pytest.mark.cpu

GROUPS, GROUP_OUT, PER_GROUP_IN, RANK, ALPHA = 4, 6, 10, 4, 8.0
SCALE = ALPHA / RANK
#: units of eps(float32) * max|reference|: both sides are a few short fp32 reductions (10-term rows, 4-term rank,
#: the cotangent sum over 6 tokens for the factor gradients), associated differently (W + s*B@A first, or the
#: adapter path apart); rounding relative to the values summed, of the reference's size; 8 leaves room
ULPS = 8
#: each group's adapter delta must exceed the output tolerance this many times, or losing it could pass
EFFECT_FACTOR = 10


@dataclass(frozen=True)
class Case:
    impl_name: str
    seed: int = 0
    tp: int = 1


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    """Full (TP=1) weight, adapter factors, input and output cotangent; identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "W": torch.randn(GROUPS * GROUP_OUT, PER_GROUP_IN, generator=gen),
        "A": torch.randn(RANK, PER_GROUP_IN, generator=gen),
        "B": torch.randn(GROUPS * GROUP_OUT, RANK, generator=gen),
        "x": torch.randn(2, 3, GROUPS, PER_GROUP_IN, generator=gen),
        "cot": torch.randn(2, 3, GROUPS, GROUP_OUT, generator=gen),
    }


def _reference(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain torch: block-diagonal product with the effective weight W + s*B@A, and the factor gradients."""
    a, b = t["A"].clone().requires_grad_(), t["B"].clone().requires_grad_()
    w_eff = (t["W"] + SCALE * (b @ a)).view(GROUPS, GROUP_OUT, PER_GROUP_IN)
    z = torch.stack([t["x"][..., g, :] @ w_eff[g].T for g in range(GROUPS)], dim=-2)
    (z * t["cot"]).sum().backward()
    return {"z": z.detach(), "dA": a.grad, "dB": b.grad}


def _wo_a_tree(
    tp: int, *, groups: int = GROUPS, group_out: int = GROUP_OUT, per_group_in: int = PER_GROUP_IN
) -> nn.Module:
    """``decoder.layers.0.self_attention.wo_a``: a real ColumnParallelLinear [G*R, H*D/G] (split by groups)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, sequence_parallel=False)
    attn = nn.Module()
    attn.wo_a = ColumnParallelLinear(
        per_group_in, groups * group_out, config=cfg, init_method=nn.init.zeros_, bias=False, gather_output=False
    )
    layer = nn.Module()
    layer.self_attention = attn
    root = nn.Module()
    root.decoder = nn.Module()
    root.decoder.layers = nn.ModuleList([layer])
    return root


def _lora_wo_a(impl, t: dict[str, torch.Tensor], *, tp: int = 1, tp_rank: int = 0, **options):
    root = _wo_a_tree(tp)
    handle = impl.apply_lora([root], targets=["wo_a"], rank=RANK, alpha=ALPHA, **options)
    module = root.decoder.layers[0].self_attention.wo_a
    rows = GROUPS * GROUP_OUT // tp
    with torch.no_grad():
        module.to_wrap.weight.copy_(t["W"][tp_rank * rows : (tp_rank + 1) * rows])
        module.adapter.linear_in.weight.copy_(t["A"].chunk(tp)[tp_rank])
        module.adapter.linear_out.weight.copy_(t["B"][tp_rank * rows : (tp_rank + 1) * rows])
    return module, handle


@pytest.fixture(scope="module")
def megatron_world(impl) -> None:
    ensure_single_rank_megatron(impl)


def test_lora_wo_a_keeps_peft_flattened_factor_shapes(impl, megatron_world):
    module, _ = _lora_wo_a(impl, _tensors(0))
    assert tuple(module.adapter.linear_in.weight.shape) == (RANK, PER_GROUP_IN), "lora_A of wo_a"
    assert tuple(module.adapter.linear_out.weight.shape) == (GROUPS * GROUP_OUT, RANK), "lora_B of wo_a"


def test_output_equals_grouped_forward_with_effective_weight(impl, megatron_world):
    t = _tensors(1)
    ref = _reference(t)
    module, _ = _lora_wo_a(impl, t)
    z = impl.apply_grouped_wo_a(module, t["x"], groups=GROUPS, group_out=GROUP_OUT)
    assert z.shape == ref["z"].shape
    tolerance = ah.assert_close_ulps(z, ref["z"], dtype=torch.float32, ulps=ULPS, name="grouped wo_a LoRA output")
    # the delta is really there in every group (nonzero B): the base alone differs by more than the tolerance
    base = torch.einsum("...gd,grd->...gr", t["x"], t["W"].view(GROUPS, GROUP_OUT, PER_GROUP_IN))
    least = min(range(GROUPS), key=lambda g: ah.max_abs(ref["z"][..., g, :] - base[..., g, :]))
    ah.assert_effect_exceeds(
        ah.max_abs(ref["z"][..., least, :] - base[..., least, :]),
        tolerance,
        factor=EFFECT_FACTOR,
        what=f"group {least}'s adapter delta",
    )


def test_gradients_reach_both_factors_and_not_the_frozen_base(impl, megatron_world):
    t = _tensors(2)
    ref = _reference(t)
    module, _ = _lora_wo_a(impl, t)
    z = impl.apply_grouped_wo_a(module, t["x"], groups=GROUPS, group_out=GROUP_OUT)
    (z * t["cot"]).sum().backward()
    ah.assert_close_ulps(module.adapter.linear_in.weight.grad, ref["dA"], dtype=torch.float32, ulps=ULPS, name="dA")
    ah.assert_close_ulps(module.adapter.linear_out.weight.grad, ref["dB"], dtype=torch.float32, ulps=ULPS, name="dB")
    assert module.to_wrap.weight.grad is None, "frozen wo_a base weight received a gradient"


def test_disabled_adapter_gives_the_base_output_bitwise(impl, megatron_world):
    t = _tensors(3)
    root = _wo_a_tree(1)
    plain = root.decoder.layers[0].self_attention.wo_a
    with torch.no_grad():
        plain.weight.copy_(t["W"])
    base = impl.apply_grouped_wo_a(plain, t["x"], groups=GROUPS, group_out=GROUP_OUT)
    impl.apply_lora([root], targets=["wo_a"], rank=RANK, alpha=ALPHA, lora_B_init_method="normal")
    wrapped = root.decoder.layers[0].self_attention.wo_a
    wrapped.disable_adapter_layers()
    assert torch.equal(impl.apply_grouped_wo_a(wrapped, t["x"], groups=GROUPS, group_out=GROUP_OUT), base)
    wrapped.enable_adapter_layers()
    assert not torch.equal(impl.apply_grouped_wo_a(wrapped, t["x"], groups=GROUPS, group_out=GROUP_OUT), base)


@pytest.mark.parametrize(
    ("groups", "group_out", "x_shape", "needle"),
    [
        (3, GROUP_OUT, (2, 3, 3, PER_GROUP_IN), "grouped weight has shape (24, 10)"),
        (GROUPS, 5, (2, 3, GROUPS, PER_GROUP_IN), "[4*5=20, in]"),
        (GROUPS, GROUP_OUT, (2, 3, 2, 2 * PER_GROUP_IN), "trailing shape (2, 20)"),
        (GROUPS, GROUP_OUT, (2, 3, GROUPS, PER_GROUP_IN + 1), "H*D/G=10"),
    ],
    ids=["wrong-groups", "wrong-group-out", "input-not-grouped", "input-width"],
)
def test_wrong_group_layouts_raise_before_any_forward(impl, megatron_world, groups, group_out, x_shape, needle):
    module, _ = _lora_wo_a(impl, _tensors(4))
    calls = []
    for sub in (module.adapter.linear_in, module.adapter.linear_out, module.adapter):
        sub.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(x_shape, requires_grad=True)
    with pytest.raises(impl.GroupedLoRAError) as err:
        impl.apply_grouped_wo_a(module, x, groups=groups, group_out=group_out)
    assert "decoder.layers.0.self_attention.wo_a" in str(err.value) and needle in str(err.value), str(err.value)
    assert not calls and x.grad is None


def test_adapter_built_for_another_layout_is_rejected(impl, megatron_world):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    module, _ = _lora_wo_a(impl, _tensors(5))
    module.adapter.linear_out = ColumnParallelLinear(
        RANK, GROUP_OUT, config=module.adapter.config, init_method=nn.init.zeros_, bias=False
    )  # a PEFT-dense adapter for ONE group's output
    with pytest.raises(impl.GroupedLoRAError, match=r"LoRA output mismatch.*lora_B gives 6 local outputs.*24"):
        impl.apply_grouped_wo_a(module, torch.randn(1, 1, GROUPS, PER_GROUP_IN), groups=GROUPS, group_out=GROUP_OUT)


def test_dense_forward_of_lora_wo_a_is_refused(impl, megatron_world):
    module, _ = _lora_wo_a(impl, _tensors(6))
    with pytest.raises(impl.GroupedLoRAError, match="apply_grouped_wo_a"):
        module(torch.randn(1, 1, GROUPS, PER_GROUP_IN))


@pytest.mark.parametrize(
    ("a_in", "b_out"),
    [(PER_GROUP_IN - 1, GROUPS * GROUP_OUT), (PER_GROUP_IN + 1, GROUPS * GROUP_OUT), (PER_GROUP_IN, 5 * GROUP_OUT)],
    ids=["lora_A-narrower", "lora_A-wider", "lora_B-more-rows"],
)
def test_an_adapter_of_another_width_or_row_count_is_refused_naming_both(impl, megatron_world, a_in, b_out):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    module, _ = _lora_wo_a(impl, _tensors(8))
    cfg = module.adapter.config
    module.adapter.linear_in = ColumnParallelLinear(a_in, RANK, config=cfg, init_method=nn.init.zeros_, bias=False)
    module.adapter.linear_out = ColumnParallelLinear(RANK, b_out, config=cfg, init_method=nn.init.zeros_, bias=False)
    with pytest.raises(impl.GroupedLoRAError) as err:
        impl.apply_grouped_wo_a(module, torch.randn(1, 1, GROUPS, PER_GROUP_IN), groups=GROUPS, group_out=GROUP_OUT)
    msg = str(err.value)
    want = (
        f"lora_A takes {a_in} inputs",
        f"lora_B gives {b_out} local outputs",
        "decoder.layers.0.self_attention.wo_a",
    )
    assert all(w in msg for w in want), f"wo_a adapter (lora_A in {a_in}, lora_B out {b_out}): {msg}"


def test_more_groups_than_the_weight_holds_are_refused(impl, megatron_world):
    """A weight with fewer rows than groups * group_out (5 groups asked of a 4-group wo_a) is a layout error too."""
    module, _ = _lora_wo_a(impl, _tensors(9))
    with pytest.raises(impl.GroupedLoRAError) as err:
        impl.apply_grouped_wo_a(module, torch.randn(2, 5, PER_GROUP_IN), groups=5, group_out=GROUP_OUT)
    msg = str(err.value)
    assert "grouped weight has shape (24, 10)" in msg and "[5*6=30, in]" in msg, f"wo_a weight 24 rows, 5 groups: {msg}"


def test_a_plain_wo_a_with_a_wrong_layout_is_refused_naming_wo_a(impl, megatron_world):
    plain = _wo_a_tree(1).decoder.layers[0].self_attention.wo_a  # no adapter, no name given
    with pytest.raises(impl.GroupedLoRAError) as err:
        impl.apply_grouped_wo_a(plain, torch.randn(2, 3, PER_GROUP_IN), groups=3, group_out=GROUP_OUT)
    assert str(err.value).startswith("wo_a: grouped weight has shape (24, 10)"), f"plain wo_a: {err.value}"


def test_any_leading_shape_is_grouped_by_its_last_two_dims(impl, megatron_world):
    """``[tokens, groups, H*D/G]`` (no batch dim) gives the reference output; a wrong one names its trailing shape."""
    t = _tensors(10)
    t["x"], t["cot"] = t["x"].reshape(6, GROUPS, PER_GROUP_IN), t["cot"].reshape(6, GROUPS, GROUP_OUT)
    ref = _reference(t)
    module, _ = _lora_wo_a(impl, t)
    z = impl.apply_grouped_wo_a(module, t["x"], groups=GROUPS, group_out=GROUP_OUT)
    ah.assert_close_ulps(z, ref["z"], dtype=torch.float32, ulps=ULPS, name="wo_a output of a 3-d input")
    with pytest.raises(impl.GroupedLoRAError) as err:
        impl.apply_grouped_wo_a(module, torch.randn(6, 2, 2 * PER_GROUP_IN), groups=GROUPS, group_out=GROUP_OUT)
    assert "trailing shape (2, 20)" in str(err.value), f"wo_a, 3-d input [6, 2, 20]: {err.value}"


def test_a_wo_a_of_real_size_computes_the_effective_weight(impl, megatron_world):
    """Sizes above 256 (a real V4's G*R and H*D/G): the layout checks compare values, not small-int identity."""
    groups, group_out, per_group_in = 2, 160, 300
    gen = torch.Generator().manual_seed(11)
    w, a = torch.randn(groups * group_out, per_group_in, generator=gen), torch.randn(RANK, per_group_in, generator=gen)
    b, x = torch.randn(groups * group_out, RANK, generator=gen), torch.randn(3, groups, per_group_in, generator=gen)
    root = _wo_a_tree(1, groups=groups, group_out=group_out, per_group_in=per_group_in)
    impl.apply_lora([root], targets=["wo_a"], rank=RANK, alpha=ALPHA)
    module = root.decoder.layers[0].self_attention.wo_a
    with torch.no_grad():
        module.to_wrap.weight.copy_(w)
        module.adapter.linear_in.weight.copy_(a)
        module.adapter.linear_out.weight.copy_(b)
    w_eff = (w + SCALE * (b @ a)).view(groups, group_out, per_group_in)
    want = torch.stack([x[..., g, :] @ w_eff[g].T for g in range(groups)], dim=-2)
    z = impl.apply_grouped_wo_a(module, x, groups=groups, group_out=group_out)
    ah.assert_close_ulps(z, want, dtype=torch.float32, ulps=4 * ULPS, name="wo_a output, G*R=320, H*D/G=300")


def test_lora_dropout_acts_on_each_groups_input_in_training_only(impl, megatron_world):
    """With ``dropout=0.5`` the grouped wo_a drops adapter inputs (Bridge's 'pre' position) as every other target
    does: in training two calls differ and a group's delta is dropped whole or not at all; in eval it is exact."""
    t = _tensors(12)
    module, _ = _lora_wo_a(impl, t, dropout=0.5)
    base = torch.einsum("...gd,grd->...gr", t["x"], t["W"].view(GROUPS, GROUP_OUT, PER_GROUP_IN))
    torch.manual_seed(0)
    module.train()
    with torch.no_grad():
        first, second = (impl.apply_grouped_wo_a(module, t["x"], groups=GROUPS, group_out=GROUP_OUT) for _ in "12")
    assert not torch.equal(first, second), "wo_a in training with dropout=0.5: two calls gave the same output"
    zero = first - base == 0  # [..., G, R]: an output is its base alone only where dropout hit
    mixed = (zero.any(-1) & ~zero.all(-1)).nonzero().tolist()
    assert not mixed, f"wo_a: dropout zeroed single outputs (post-adapter dropout) at [..., group] {mixed[:4]}"
    module.eval()
    z = impl.apply_grouped_wo_a(module, t["x"], groups=GROUPS, group_out=GROUP_OUT)
    ah.assert_close_ulps(z, _reference(t)["z"], dtype=torch.float32, ulps=ULPS, name="wo_a output in eval")


# ---------------------------------------------------------------------------------------------------- TP=2


def _rank_grouped_wo_a(rank: int, world_size: int, case: Case) -> dict:
    import torch.distributed as dist

    impl = load_impl(case.impl_name)  # imported before Megatron (CPU shims)

    init_megatron_parallel(tp=case.tp)
    t = _tensors(case.seed)
    module, _ = _lora_wo_a(impl, t, tp=case.tp, tp_rank=rank)
    local = GROUPS // case.tp
    x = t["x"][..., rank * local : (rank + 1) * local, :].contiguous()
    z = impl.apply_grouped_wo_a(module, x, groups=local, group_out=GROUP_OUT)
    (z * t["cot"][..., rank * local : (rank + 1) * local, :]).sum().backward()
    parts = [torch.empty_like(z) for _ in range(world_size)]
    dist.all_gather(parts, z.detach().contiguous())
    # plain lists: tensors would travel through shared memory that dies with the rank process
    return {
        "z": torch.cat(parts, dim=-2).tolist(),
        "dA": module.adapter.linear_in.weight.grad.tolist(),
        "dB": module.adapter.linear_out.weight.grad.tolist(),
    }


def test_tp2_grouped_wo_a_lora_equals_tp1(impl):
    case = Case(impl.name, seed=7, tp=2)
    results = run_ranks(_rank_grouped_wo_a, case, nproc=2, timeout_s=120, preload=impl_preload(impl.name))
    ref = _reference(_tensors(case.seed))
    for r, res in enumerate(results):
        got = {k: torch.tensor(v) for k, v in res.payload.items()}
        rows = GROUPS * GROUP_OUT // 2
        shards = {"z": ref["z"], "dA": ref["dA"].chunk(2)[r], "dB": ref["dB"][r * rows : (r + 1) * rows]}
        for key, want in shards.items():
            # at the full tensor's scale: a shard rounds like the sums it shares with the whole
            ah.assert_close_ulps(
                got[key],
                want,
                dtype=torch.float32,
                ulps=ULPS,
                scale=ah.max_abs(ref[key]),
                name=f"{key} (gathered)" if key == "z" else f"{key} shard",
                context=f"rank {r}",
            )

"""#4131 / #4305: the Flash LoRA recipe next to the installed Megatron-Bridge's own Flash SFT recipe.

The upstream recipe function is run from the installed pin (``fixtures.data.upstream_recipe``: only the Hub download and
the data stack are stood in for) on a simulated H100 and B200. :data:`SHARED` lists every setting the two recipes
share (parallel layout, pipeline layout, dtype, dispatcher, recompute, fusions, sequence settings): each must equal
upstream's value, or carry the LoRA-specific reason it differs (and still differ). Rope fusion (#4305) is carried
by the recipe; the native graph runs its rope unfused and names why (``impl.ROPE_FUSION_FALLBACKS``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from fixtures.data.simulated_accelerators import simulate_hardware
from fixtures.data.upstream_recipe import build_upstream_flash_sft

pytestmark = pytest.mark.cpu

RECOMPUTE = (
    "the LoRA recipe trains the native V4 graph (Miles layout, frozen base): at micro-batch 1 x 4096 tokens with 4 "
    "micro-batches in flight its stage-0 rank would keep ~241 GB of activations without whole-layer recompute "
    "(upstream's selective moe_act/mhc spares only those two parts) and keeps ~45 GB with it "
    "(recipes/deepseek_v4_flash_lora.md, memory table; suites/reference/test_memory_model.py)"
)


@dataclass(frozen=True)
class Shared:
    """One setting both recipes carry: upstream's provider attribute (or ``dataset.<kwarg>``), ours as a getter."""

    group: str
    upstream: str
    ours: Callable[[Any], Any]
    differs: str | None = None  # the LoRA-specific reason ours differs; None: must equal upstream


def _stages(layout: Any) -> list[list[str]]:
    return [list(stage) for stage in layout]


SHARED: tuple[Shared, ...] = (
    Shared("parallel layout", "tensor_model_parallel_size", lambda r: r.tp),
    Shared("parallel layout", "pipeline_model_parallel_size", lambda r: r.pp),
    Shared("parallel layout", "expert_model_parallel_size", lambda r: r.ep),
    Shared("parallel layout", "expert_tensor_parallel_size", lambda r: r.expert_tensor_parallel_size),
    Shared("parallel layout", "context_parallel_size", lambda r: r.context_parallel_size),
    Shared("parallel layout", "virtual_pipeline_model_parallel_size", lambda r: r.vpp),
    Shared("pipeline layout", "pipeline_model_parallel_layout", lambda r: _stages(r.pipeline_layout)),
    Shared("pipeline layout", "mtp_num_layers", lambda r: r.model.mtp_layers if r.include_mtp else None),
    Shared("dtype", "params_dtype", lambda r: r.params_dtype),
    Shared("dtype", "pipeline_dtype", lambda r: r.params_dtype),
    Shared("dispatcher", "moe_token_dispatcher_type", lambda r: r.moe_token_dispatcher_type),
    Shared("recompute", "recompute_granularity", lambda r: r.recompute_granularity, RECOMPUTE),
    Shared("recompute", "recompute_modules", lambda r: list(r.recompute_modules), RECOMPUTE),
    Shared("recompute", "recompute_method", lambda r: r.recompute_method, RECOMPUTE),
    Shared("recompute", "recompute_num_layers", lambda r: r.recompute_num_layers, RECOMPUTE),
    Shared("fusions", "apply_rope_fusion", lambda r: r.apply_rope_fusion),
    Shared("fusions", "use_fused_mhc", lambda r: r.fused.use_fused_mhc),
    Shared("fusions", "apply_dsa_kernel_fusion", lambda r: r.fused.apply_dsa_kernel_fusion),
    Shared("sequence", "seq_length", lambda r: r.seq_length),
    Shared("sequence", "sequence_parallel", lambda r: r.sequence_parallel),
    Shared("sequence", "dataset.seq_length", lambda r: r.seq_length),
    Shared("sequence", "dataset.packed", lambda r: r.packed_sequences),
)

#: the dataset keyword each pin's recipe uses for sequence packing
PACKING_KWARGS = ("packed_sequence", "enable_offline_packing")


def _upstream_value(upstream: Any, name: str) -> Any:
    if name == "dataset.packed":
        return next(upstream.dataset[k] for k in PACKING_KWARGS if k in upstream.dataset)
    if name.startswith("dataset."):
        return upstream.dataset[name.removeprefix("dataset.")]
    value = getattr(upstream.model, name)
    return list(value) if isinstance(value, tuple) else value


@pytest.fixture(params=["h100", "b200"])
def both_recipes(request, impl, monkeypatch):
    """(ours, upstream's, hardware) built on the same simulated host (with the DSA kernel packages importable)."""
    simulate_hardware(monkeypatch, request.param, dsa_kernels=True)
    upstream = build_upstream_flash_sft(monkeypatch)
    return impl.deepseek_v4_flash_lora_recipe(), upstream, request.param


def test_every_shared_setting_equals_the_installed_upstream_sft_recipe_or_states_why(both_recipes):
    ours, upstream, hardware = both_recipes
    problems = []
    for row in SHARED:
        mine, theirs = row.ours(ours), _upstream_value(upstream, row.upstream)
        where = f"{row.group} / {row.upstream} on {hardware} (megatron-bridge {upstream.pin})"
        if row.differs is None and mine != theirs:
            problems.append(f"{where}: ours {mine!r}, upstream {theirs!r} ({upstream.source})")
        elif row.differs is not None and mine == theirs:
            problems.append(f"{where}: both {mine!r}; the stated difference closed, drop it: {row.differs}")
    assert not problems, "\n".join(problems)


def test_rope_fusion_follows_the_upstream_recipe_with_no_hardware_gate(impl, monkeypatch):
    """#4305: upstream fuses rope on every host (fused mHC alone is gated); so does the recipe, whatever the GPU."""
    for hardware in ("no-cuda", "h100", "b200"):
        simulate_hardware(monkeypatch, hardware, dsa_kernels=False)
        upstream = build_upstream_flash_sft(monkeypatch)
        ours = impl.deepseek_v4_flash_lora_recipe()
        assert upstream.model.apply_rope_fusion is True, f"{upstream.source} on {hardware}"
        assert ours.apply_rope_fusion is upstream.model.apply_rope_fusion, f"recipe on {hardware}"
        assert impl.tiny_variant(ours).apply_rope_fusion is True, "the tiny variant must keep rope fusion"


@pytest.mark.parametrize(
    ("hardware", "reason"), [("no-cuda", "no-cuda"), ("h100", "no-v4-kernel"), ("b200", "no-v4-kernel")]
)
def test_native_graph_names_why_it_runs_the_rope_unfused(impl, monkeypatch, hardware, reason):
    simulate_hardware(monkeypatch, hardware, dsa_kernels=False)
    with pytest.warns(impl.RopeFusionFallbackWarning, match=rf"\({reason}\)"):
        decision = impl.decide_rope_fusion(True)
    assert (decision.requested, decision.applied) == (True, False), decision
    assert decision.fallback is impl.ROPE_FUSION_FALLBACKS[reason], f"{hardware}: {decision.fallback}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = impl.decide_rope_fusion(False)
    assert (quiet.applied, quiet.fallback) == (False, None), "no request, no fallback"


def test_native_provider_records_the_recipes_rope_fusion_request(impl, monkeypatch):
    from tiny_models.presets import get_preset

    simulate_hardware(monkeypatch, "no-cuda", dsa_kernels=False)
    recipe = impl.tiny_variant(impl.deepseek_v4_flash_lora_recipe())
    provider = impl.DeepseekV4NativeProvider(
        hf_config=get_preset(recipe.preset), apply_rope_fusion=recipe.apply_rope_fusion, params_dtype=torch.float32
    )
    with pytest.warns(impl.RopeFusionFallbackWarning, match="no-cuda"):
        provider.finalize()
    assert provider.rope_fusion.requested and not provider.rope_fusion.applied, provider.rope_fusion
    assert provider.rope_fusion.fallback.name == "no-cuda"

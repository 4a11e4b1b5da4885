"""What each consumer (vLLM per release and platform, SGLang, PEFT on transformers) does with an adapter, per
naming dialect and target: the rules the judge holds an adapter to, and the exporter of the reference fails closed
by (``export --consumer``, ``verify-adapter --consumer``).

Each row is read from the engine's own code and names the file and function that decides; it is checked against the
installed engines, one environment per release, by ``suites/reference/test_consumers.py`` (probes run their
loaders, name mappers, packing, target normalization and forward code on exported adapters: ``fixtures/consumers``),
which fails on every cell where the engine's answer differs from a row here, and on a row no installed release
answered. Dialects: ``transformers`` (``model.layers.N.self_attn.q_a_proj``), ``official``
(``layers.N.attn.wq_a``), ``sglang`` (``model.layers.N.self_attn.wq_a``). Targets: the five main-attention
projections, :data:`MTP` (the five on the MTP layer, official naming only) and :data:`WHOLE_ADAPTER` (does the
engine accept the adapter at all). Nothing here imports an implementation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from dsv4_conformance.driver import MAIN_ATTENTION
from dsv4_conformance.judge.artifacts import TRANSFORMERS_LEAF


class ConsumerStatus(StrEnum):
    APPLIED = "applied"  # loaded and applied by the forward pass
    LOADED_NOT_APPLIED = "loaded_not_applied"  # loaded, but no forward path applies it
    SKIPPED = "skipped"  # dropped while loading, without an error
    REJECTED = "rejected"  # loading (or engine start-up with the adapter) raises
    ROUTED_ELSEWHERE = "routed_elsewhere"  # attached to a different module than the one trained
    LOADED = "loaded"  # WHOLE_ADAPTER only: the engine accepts the adapter


#: target name of the row about the MTP layer's five targets
MTP = "mtp"
#: target name of the row about the adapter as a whole
WHOLE_ADAPTER = "(adapter)"
#: the per-target rows, in export order
TARGET_LEAVES: tuple[str, ...] = MAIN_ATTENTION


@dataclass(frozen=True)
class ConsumerRule:
    consumer: str  # engine[/platform variant], e.g. "vllm/nvidia", "sglang"
    version: str
    dialect: str  # impl.adapter.dialects.DIALECTS key
    target: str  # a TARGET_LEAVES entry, MTP or WHOLE_ADAPTER
    status: ConsumerStatus
    why: str  # the engine's decision and where it is made
    routed_to: str | None = None  # the engine's name for the target when its normalization renames it


S = ConsumerStatus

_VLLM_LOADER = "vllm/lora/lora_model.py:LoRAModel.from_local_checkpoint"
_VLLM_ACTIVATE = "vllm/lora/model_manager.py:LoRAModelManager.activate_adapter"
_VLLM_PACKED = "packed into attn.fused_wqa_wkv (DeepseekV4ForCausalLM.packed_modules_mapping), called in forward"


def _vllm_lora_model(
    version: str, variant: str, wo_a_reader: str | None = None, *, wo_a_applier: str | None = None
) -> list[ConsumerRule]:
    """A vLLM platform model that implements SupportsLoRA (names checked by leaf, official names mapped by
    hf_to_vllm_mapper, MTP skipped by lora_skip_prefixes). wo_a: ``wo_a_reader`` hands its weight to a kernel (the
    LoRA is never applied), or the o-projection calls ``wo_a_applier``, the LoRA class's own method (applied)."""
    c = f"vllm/{variant}"
    if wo_a_applier is not None:
        wo_a = (
            S.APPLIED,
            f"the o-projection calls attn.wo_a.grouped_forward, which {wo_a_applier} overrides to add the delta",
        )
    else:
        wo_a = (S.LOADED_NOT_APPLIED, f"wrapped, but the forward never calls attn.wo_a: {wo_a_reader} reads its weight")
    rejected = f"leaf names q_a_proj/... are no module leaves of vLLM's model: {_VLLM_LOADER} raises ValueError"
    unapplied = f"model.layers.N.self_attn.<leaf> is no vLLM module (vLLM's is model.layers.N.attn): {_VLLM_ACTIVATE} finds no layer for it"
    official = {
        "wq_a": (S.APPLIED, _VLLM_PACKED),
        "wq_b": (S.APPLIED, "attn.wq_b is called in DeepseekV4Attention._wq_b_proj"),
        "wkv": (S.APPLIED, _VLLM_PACKED),
        "wo_a": wo_a,
        "wo_b": (S.APPLIED, "attn.wo_b is called by the o-projection"),
        MTP: (S.SKIPPED, "DeepseekV4ForCausalLM.lora_skip_prefixes ['mtp.'] (LoRAModel._should_skip_module)"),
        WHOLE_ADAPTER: (S.LOADED, f"{_VLLM_LOADER} accepts it"),
    }
    rows = [ConsumerRule(c, version, "transformers", t, S.REJECTED, rejected) for t in (*TARGET_LEAVES, WHOLE_ADAPTER)]
    rows += [ConsumerRule(c, version, "official", t, s, why) for t, (s, why) in official.items()]
    rows += [ConsumerRule(c, version, "sglang", t, S.LOADED_NOT_APPLIED, unapplied) for t in TARGET_LEAVES]
    rows.append(ConsumerRule(c, version, "sglang", WHOLE_ADAPTER, S.LOADED, f"{_VLLM_LOADER} accepts it"))
    return rows


def _vllm_without_lora(version: str, variant: str) -> list[ConsumerRule]:
    why = (
        f"vllm/models/deepseek_v4/{variant}/model.py:DeepseekV4ForCausalLM does not implement SupportsLoRA: "
        "vllm/config/lora.py:LoRAConfig.verify_with_model_config refuses to start with LoRA"
    )
    rows = []
    for dialect in ("transformers", "official", "sglang"):
        targets = (*TARGET_LEAVES, WHOLE_ADAPTER, *((MTP,) if dialect == "official" else ()))
        rows += [ConsumerRule(f"vllm/{variant}", version, dialect, t, S.REJECTED, why) for t in targets]
    return rows


def _sglang(version: str) -> list[ConsumerRule]:
    """SGLang normalizes target_modules before anything else and sizes a LoRA buffer per target at start-up;
    its DeepseekV4ForCausalLM has no LoRA hooks (no get_hidden_dim), so no V4 target can be sized."""
    c = "sglang"
    regex = "target_modules is a regex string: sglang/srt/lora/lora_manager.py:LoRAManager.init_lora_shapes raises"
    unsized = (
        "sglang/srt/lora/utils.py:get_default_hidden_dim has no shape for {leaf} and DeepseekV4ForCausalLM "
        "defines no get_hidden_dim: LoRAMemoryPool.init_buffers raises NotImplementedError"
    )
    wq_b = (
        "sglang/srt/lora/utils.py:get_normalized_target_modules maps a bare wq_b to indexer.wq_b; sizing that "
        "asserts is_deepseek_dsa (false for V4); past it SGLang would wrap the indexer's wq_b and skip the weights"
    )
    rows = [ConsumerRule(c, version, "transformers", t, S.REJECTED, regex) for t in (*TARGET_LEAVES, WHOLE_ADAPTER)]
    for dialect in ("official", "sglang"):
        for leaf in TARGET_LEAVES:
            if leaf == "wq_b":
                rows.append(ConsumerRule(c, version, dialect, leaf, S.REJECTED, wq_b, routed_to="indexer.wq_b"))
            else:
                rows.append(ConsumerRule(c, version, dialect, leaf, S.REJECTED, unsized.format(leaf=leaf)))
        rows.append(ConsumerRule(c, version, dialect, WHOLE_ADAPTER, S.REJECTED, "every V4 target is refused"))
    rows.append(ConsumerRule(c, version, "official", MTP, S.REJECTED, "every V4 target is refused"))
    return rows


def _peft(version: str) -> list[ConsumerRule]:
    """PEFT on transformers' DeepseekV4ForCausalLM: target_modules matched against transformers' module paths."""
    loader = "peft/peft_model.py:PeftModel.from_pretrained"
    merged = (
        "transformers' self_attn.{leaf} is a LoRA-wrapped nn.Linear; PEFT's merge_and_unload folds it into the weight "
        "the forward uses"
    )
    grouped = (
        f"{merged.format(leaf='o_a_proj')} (unmerged, stock PEFT's dense LoRA forward raises on the grouped layer: "
        "merge, or impl.load_peft_adapter)"
    )
    leaf_of = TRANSFORMERS_LEAF
    rows = [
        ConsumerRule(
            "peft", version, "transformers", t, S.APPLIED, grouped if t == "wo_a" else merged.format(leaf=leaf_of[t])
        )
        for t in TARGET_LEAVES
    ]
    rows.append(ConsumerRule("peft", version, "transformers", WHOLE_ADAPTER, S.LOADED, f"{loader} accepts it"))
    unknown = (
        f"target_modules lists leaves transformers' model does not have: {loader} raises NoMatchingPeftModuleError"
    )
    for dialect in ("official", "sglang"):
        targets = (*TARGET_LEAVES, WHOLE_ADAPTER, *((MTP,) if dialect == "official" else ()))
        rows += [ConsumerRule("peft", version, dialect, t, S.REJECTED, unknown) for t in targets]
    return rows


_XPU_O_PROJ = "vllm/models/deepseek_v4/xpu/xpu_sparse.py:DeepseekV4XPUAttention._o_proj"

#: The table: one block per engine release a lane runs (fixtures/consumers LANES). Rows for vLLM's ROCm model are
#: absent: it does not import on a CPU host, so nothing checks them.
CONSUMER_RULES: tuple[ConsumerRule, ...] = (
    *_vllm_lora_model("0.33.0", "nvidia", "vllm/models/deepseek_v4/nvidia/ops/o_proj.py:deep_gemm_fp8_o_proj"),
    *_vllm_lora_model("0.33.0", "xpu", _XPU_O_PROJ),
    *_vllm_without_lora("0.33.0", "cpu"),
    # 0.34 wraps wo_a in DeepseekV4GroupedWoAWithLoRA; NVIDIA's _o_proj calls its grouped_forward, XPU's reads
    # wo_a.bmm_weight (the wrapper hands the base layer's through)
    *_vllm_lora_model("0.34.0", "nvidia", wo_a_applier="vllm/lora/layers/custom_layer.py:DeepseekV4GroupedWoAWithLoRA"),
    *_vllm_lora_model("0.34.0", "xpu", _XPU_O_PROJ),
    *_vllm_without_lora("0.34.0", "cpu"),
    *_sglang("0.5.23"),
    *_peft("0.21.2"),
)
_BY_KEY = {(r.consumer, r.version, r.dialect, r.target): r for r in CONSUMER_RULES}


def consumer_rule(consumer: str, version: str, dialect: str, target: str) -> ConsumerRule | None:
    """The rule for one cell, or None where there is none (an engine release no lane ran)."""
    return _BY_KEY.get((consumer, version, dialect, target))


def _release_key(version: str) -> tuple:
    """``0.34.0`` -> (0, 34, 0): releases in numeric order (``0.10`` after ``0.9``)."""
    return tuple(int(p) if p.isdigit() else p for p in version.split("."))


def tested_versions(engines: Iterable[str]) -> list[str]:
    """The releases the table holds rules for on all of ``engines``, oldest first: exactly the releases some lane ran
    (``suites/reference/test_consumers.py`` fails on a row no installed lane answered)."""
    per_engine = [{r.version for r in CONSUMER_RULES if r.consumer == e} for e in engines]
    common = set.intersection(*per_engine) if per_engine else set()
    return sorted(common, key=_release_key)


def unapplied_targets(consumer: str, version: str, dialect: str, targets: tuple[str, ...]) -> list[ConsumerRule]:
    """The rows for ``targets`` whose status is anything but applied (what a fail-closed export will refuse)."""
    rules = [consumer_rule(consumer, version, dialect, t) for t in targets]
    return [r for r in rules if r is not None and r.status is not ConsumerStatus.APPLIED]


# ------------------------------------------------------------------------- adapters on other modules than the five

#: PEFT wraps whatever ``nn.Linear`` its ``target_modules`` selects and the forward calls it, so a LoRA on any
#: linear module of transformers' model is applied (``suites/reference/test_producer_peft.py`` runs it). Kept apart from
#: :data:`CONSUMER_RULES`, whose every row the engines' own code is probed for.
OFF_TARGET_PEFT = (
    "peft/tuners/lora/model.py:LoraModel._create_and_replace wraps the nn.Linear target_modules selects; "
    "the forward calls it"
)
#: what a LoRA on a module of each kind changes (the hazard the consequence line names)
OFF_TARGET_HAZARD = {
    "indexer": "the indexer chooses which compressed tokens the sparse attention reads (the wq_b hazard: a bare "
    "q_b_proj/kv_proj suffix also wraps the indexer's)",
    "compressor": "the compressor builds the compressed KV every compressed layer reads (a bare kv_proj suffix "
    "also wraps compressor.kv_proj)",
}


__all__ = [
    "CONSUMER_RULES",
    "MTP",
    "OFF_TARGET_HAZARD",
    "OFF_TARGET_PEFT",
    "TARGET_LEAVES",
    "WHOLE_ADAPTER",
    "ConsumerRule",
    "ConsumerStatus",
    "consumer_rule",
    "tested_versions",
    "unapplied_targets",
]

"""The native DeepSeek-V4 provider: builds model chunks for a TP / EP / PP (/ virtual PP) layout.

V4 is never routed through Megatron-Bridge's AutoBridge provider selection: the HF config is checked with
:func:`impl.conversion.detect.require_deepseek_v4_config` and the layout validated before anything is built. Bridge's
own ``provide_distributed_model`` then runs the pre-wrap hooks (PEFT) on the bare chunks **before** DDP wrapping, so
DDP's gradient buffers hold exactly the parameters the hooks left trainable."""

from __future__ import annotations

import impl.compat.active  # noqa: F401  (the CPU compat layer must precede every megatron import)

# isort: split

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.bridge.models.model_provider import ModelProviderMixin
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.module import MegatronModule

from impl.conversion.detect import require_deepseek_v4_config
from impl.conversion.pipeline import Layout, resolve_pipeline_layout, stage_layer_numbers
from impl.errors import MultiLoRAUnsupportedError, UnsupportedConfigError
from impl.native.activations import ActivationPlan
from impl.native.config import V4Config
from impl.native.model import DeepseekV4NativeModel, validate_parallel_layout
from impl.native.parallel import cpu_initialization
from impl.native.rope import RopeFusion, decide_rope_fusion

#: Megatron's default ``--seed``; used only when a GPU build finds the model-parallel RNG unseeded.
DEFAULT_SEED = 1234

#: parameter dtypes the native graph is built in
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

PreWrapHook = Callable[[list[MegatronModule]], list[MegatronModule] | None]

__all__ = [
    "DeepseekV4NativeProvider",
    "build_native_model",
]


def reject_multi_lora(enabled: bool) -> None:
    if enabled:
        raise MultiLoRAUnsupportedError(
            "Multi-LoRA is not supported on the native DeepSeek-V4 graph; train one adapter per run "
            "(this is rejected before anything is built rather than silently falling back)"
        )


@dataclass
class DeepseekV4NativeProvider(ModelProviderMixin[DeepseekV4NativeModel]):
    """Megatron-Bridge ``ModelProviderMixin`` whose ``provide`` builds the native V4 graph for one stage."""

    hf_config: Any
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_layout: Any = None
    include_mtp: bool = False
    params_dtype: torch.dtype = torch.float32
    activations: ActivationPlan = field(default_factory=ActivationPlan)
    apply_rope_fusion: bool = False  # the recipe's request; ``rope_fusion`` says what the graph does with it
    fp16: bool = False
    bf16: bool = False
    v4_config: V4Config | None = field(default=None, init=False)
    resolved_layout: Layout | None = field(default=None, init=False)
    rope_fusion: RopeFusion | None = field(default=None, init=False)

    def finalize(self) -> None:
        require_deepseek_v4_config(self.hf_config)
        cfg = V4Config.from_hf(self.hf_config)
        for name in ("tensor_model_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise UnsupportedConfigError(f"{name}={getattr(self, name)} must be >= 1")
        validate_parallel_layout(cfg, tp_size=self.tensor_model_parallel_size, ep_size=self.expert_model_parallel_size)
        stages = self.pipeline_model_parallel_size * (self.virtual_pipeline_model_parallel_size or 1)
        mtp = cfg.num_mtp_layers if self.include_mtp else 0
        self.resolved_layout = resolve_pipeline_layout(
            self.pipeline_layout,
            num_layers=cfg.num_layers,
            stages=stages,
            num_hash_layers=cfg.num_hash_layers,
            mtp_layers=mtp,
        )
        self.rope_fusion = decide_rope_fusion(self.apply_rope_fusion)
        self.v4_config = cfg

    def stage_index(self, vp_stage: int | None) -> int:
        pp = self.pipeline_model_parallel_size
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
        return (vp_stage or 0) * pp + pp_rank

    def provide(
        self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None
    ) -> DeepseekV4NativeModel:
        if self.v4_config is None:
            self.finalize()
        stage = self.stage_index(vp_stage)
        tokens = self.resolved_layout[stage]
        return DeepseekV4NativeModel(
            self.v4_config,
            pre_process="embedding" in tokens if pre_process is None else pre_process,
            post_process="loss" in tokens if post_process is None else post_process,
            layer_numbers=list(stage_layer_numbers(self.resolved_layout, stage)),
            include_mtp="mtp" in tokens,
            params_dtype=self.params_dtype,
            activations=self.activations,
        )


def _check_parallel_state(tp: int, ep: int, pp: int) -> None:
    if not parallel_state.model_parallel_is_initialized():
        raise UnsupportedConfigError(
            "megatron parallel state is not initialized: call torch.distributed.init_process_group and "
            f"parallel_state.initialize_model_parallel(tensor_model_parallel_size={tp}, "
            f"pipeline_model_parallel_size={pp}, expert_model_parallel_size={ep}) first"
        )
    have = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if have != (tp, ep, pp):
        raise UnsupportedConfigError(
            f"requested (tp, ep, pp)={(tp, ep, pp)} but parallel state is initialized as {have}"
        )


def _ensure_model_parallel_rng() -> None:
    """GPU initialization draws from Megatron's model-parallel RNG tracker; seed it if the caller has not."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
        model_parallel_cuda_manual_seed(DEFAULT_SEED)


def build_native_model(
    hf_config: Any,
    *,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    pipeline_layout: Any = None,
    include_mtp: bool = False,
    pre_wrap_hooks: Sequence[PreWrapHook] = (),
    wrap_with_ddp: bool = False,
    ddp_config: DistributedDataParallelConfig | None = None,
    multi_lora: bool = False,
    params_dtype: torch.dtype = torch.float32,
    activations: ActivationPlan | None = None,
    apply_rope_fusion: bool = False,
) -> list[MegatronModule]:
    """Build this rank's V4 model chunks; run ``pre_wrap_hooks`` (e.g. LoRA) before any DDP wrapping.

    ``activations`` (:class:`impl.native.activations.ActivationPlan`) sets recompute and the attention's
    query-block path. ``apply_rope_fusion`` is the recipe's request (the provider's ``rope_fusion`` records the
    decision; the native graph falls back with a named reason, :data:`impl.native.rope.ROPE_FUSION_FALLBACKS`).
    ``params_dtype`` is float32 or bfloat16 (the recipe's). In bf16 the weights (and LoRA adapters) are bf16 while
    the tensors the checkpoint keeps in fp32 stay fp32 (``attn_sink``, ``ape``, ``hc_*``, the expert bias); the
    default DDP config then reduces gradients into fp32 ``main_grad`` buffers (``grad_reduce_in_fp32``), and
    Megatron's optimizer keeps fp32 master weights (:func:`impl.adapter_optimizer`), as Megatron does for bf16.
    Everything that can be rejected (non-V4 config, Multi-LoRA, unsupported layout or dtype) is rejected
    before a single parameter is allocated.
    """
    reject_multi_lora(multi_lora)
    if params_dtype not in SUPPORTED_DTYPES:
        raise UnsupportedConfigError(
            f"params_dtype={params_dtype} is not supported; use one of {list(SUPPORTED_DTYPES)} (the published "
            "recipes train in bf16; fp16 would need loss scaling, which the native graph does not carry)"
        )
    require_deepseek_v4_config(hf_config)
    provider = DeepseekV4NativeProvider(
        hf_config=hf_config,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_layout=pipeline_layout,
        include_mtp=include_mtp,
        # stated here too: Megatron-Bridge 0.5.x's get_model does not set it from the bf16 flag below (0.6 does)
        params_dtype=params_dtype,
        activations=activations or ActivationPlan(),
        apply_rope_fusion=apply_rope_fusion,
    )
    provider.finalize()
    _check_parallel_state(tp, ep, pp)
    on_cpu = cpu_initialization()
    if not on_cpu:
        _ensure_model_parallel_rng()
    if wrap_with_ddp and ddp_config is None:
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
            grad_reduce_in_fp32=params_dtype != torch.float32,
        )
    # get_model sets the provider's params_dtype from these flags; the model is built in that dtype directly
    # (no Float16Module: it would also cast the fp32 hc / sink / ape tensors).
    return provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=wrap_with_ddp,
        fp16=False,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        pre_wrap_hook=list(pre_wrap_hooks) or None,
        mixed_precision_wrapper=None,
    )

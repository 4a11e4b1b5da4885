"""A LoRA recipe for DeepSeek-V4-Flash on 4 nodes x 8 GPUs, and its tiny twin that runs on 2 CPU ranks.

Megatron-Bridge ships Flash SFT recipes but no LoRA one: :func:`deepseek_v4_flash_lora_recipe` keeps the SFT parallel
layout and adds LoRA. :func:`tiny_variant` keeps every structural choice on a tiny model, so :func:`to_qualify_args`
drives the same recipe through ``dsv4-lora qualify`` on a CPU host. Model shapes are data in ``model_shapes.toml``.
Importing this module must not import megatron: the launch scripts build recipes cheaply."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from impl.conversion.hardware import FusedKernelDefaults, fused_kernel_defaults
from impl.conversion.pipeline import Layout, generate_pipeline_layout, validate_pipeline_layout
from impl.data_tables import checked_keys, read_table_file
from impl.errors import UnsupportedConfigError
from impl.vocabulary import TARGET_TABLE

__all__ = [
    "CHECKPOINT_ENV",
    "DeepseekV4LoRARecipe",
    "FLASH_SHAPE",
    "ModelShape",
    "OptimizerSettings",
    "PRO_SHAPE",
    "TINY_MODELS",
    "TinyModel",
    "deepseek_v4_flash_lora_recipe",
    "deepseek_v4_pro_lora_recipe",
    "sft_fused_kernel_defaults",
    "tiny_variant",
    "to_qualify_args",
]

CHECKPOINT_ENV = "DSV4_FLASH_CHECKPOINT"
#: The main attention projections of the target table. The grouped one (``wo_a``) gets the block-diagonal
#: grouped LoRA of impl.lora.wrappers, which plain PEFT-on-transformers recipes must skip.
ATTENTION_TARGETS = TARGET_TABLE.main_names


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts a parallel layout depends on."""

    name: str
    num_layers: int
    num_hash_layers: int
    mtp_layers: int
    num_experts: int
    num_heads: int
    o_groups: int
    vocab_size: int


@dataclass(frozen=True)
class TinyModel:
    """A tiny preset as the recipe sees it: its layout facts and its shortest full-coverage sequence.

    Stated in ``model_shapes.toml`` rather than read from the suite's presets, so the recipe never reads the oracle;
    the CLI writes the preset's base under the same name.
    """

    shape: ModelShape
    seq_length: int  # twice the sliding window, >= 2 entries per compressed layer, top-k really choosing


SHAPES_FILE = Path(__file__).with_name("model_shapes.toml")
_SHAPE_KEYS = frozenset(f.name for f in fields(ModelShape))


def _checked(entry: Any, where: str, keys: frozenset[str]) -> dict:
    return checked_keys(entry, f"{SHAPES_FILE.name}: {where}", UnsupportedConfigError, required=keys)


def _load() -> tuple[dict[str, ModelShape], dict[str, TinyModel]]:
    data = _checked(read_table_file(SHAPES_FILE, UnsupportedConfigError), "top level", frozenset({"full", "tiny"}))
    full = _checked(data["full"], "[full]", frozenset({"flash", "pro"}))
    shapes = {name: ModelShape(**_checked(entry, f"[full.{name}]", _SHAPE_KEYS)) for name, entry in full.items()}
    tiny = {}
    for name, entry in data["tiny"].items():  # named by the table; seq_length is the TinyModel's
        shape = dict(_checked(entry, f"[tiny.{name!r}]", _SHAPE_KEYS - {"name"} | {"seq_length"}))
        seq_length = shape.pop("seq_length")
        tiny[name] = TinyModel(ModelShape(name=name, **shape), seq_length=seq_length)
    return shapes, tiny


_SHAPES, _TINY = _load()
#: DeepSeek-V4-Flash, from the published config.json (docs/reference/v4_architecture.md §2.1).
FLASH_SHAPE = _SHAPES["flash"]
#: DeepSeek-V4-Pro, from the published config.json (docs/reference/v4_architecture.md §2.1).
PRO_SHAPE = _SHAPES["pro"]
#: The tiny presets a tiny variant may run on.
TINY_MODELS: dict[str, TinyModel] = _TINY


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam on the adapters only (the base is frozen, so these settings touch only LoRA A/B)."""

    name: str = "adam"
    lr: float = 1e-4  # the usual LoRA lr for 7B+ bases; 10x the SFT lr because only low-rank factors move
    min_lr: float = 1e-5
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 50  # LoRA B starts at zero: a short warmup keeps the first updates from overshooting
    train_iters: int = 1000
    weight_decay: float = 0.0  # decay would pull the adapters toward 0, i.e. toward "no fine-tuning"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = True  # upstream SFT is Adam/bf16 only (MXFP8 and Muon SFT fail upstream)


def sft_fused_kernel_defaults() -> FusedKernelDefaults:
    """The hardware gate's defaults as upstream's Flash SFT recipes use them (#4131): fused mHC where the gate says,
    DSA always unfused (they set ``apply_dsa_kernel_fusion=False`` on every host)."""
    return replace(fused_kernel_defaults(), apply_dsa_kernel_fusion=False)


@dataclass(frozen=True)
class DeepseekV4LoRARecipe:
    """Everything a DeepSeek-V4 LoRA run needs; validated on construction (raises UnsupportedConfigError)."""

    model: ModelShape
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    ep: int
    pipeline_layout: Layout
    vpp: int | None = None
    targets: tuple[str, ...] = ATTENTION_TARGETS
    # r=16 / alpha=32 / dropout=0.05: the public DeepSeek-V4-Flash PEFT recipe (self-llm PR #512); alpha = 2r
    # keeps the update scale alpha/r = 2 independent of r, and 0.05 dropout is the common small-data regulariser.
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    fused: FusedKernelDefaults = field(default_factory=sft_fused_kernel_defaults)
    # #4305: upstream's Flash SFT recipes fuse rope on every host, with no hardware gate (unlike fused mHC), once
    # #4271 kept the full rope width. The native graph says when it runs unfused (impl.native.rope fallbacks).
    apply_rope_fusion: bool = True
    micro_batch_size: int = 1
    global_batch_size: int = 128
    seq_length: int = 4096  # Megatron-Bridge's V4 provider default
    moe_token_dispatcher_type: str = "alltoall"  # the SFT recipe's choice (flex/HybridEP needs DeepEP kernels)
    # Megatron's recompute options, honoured by the native layers (impl.ActivationPlan). Upstream SFT recomputes
    # moe_act/mhc selectively; the native graph's activations on stage 0 do not fit without whole-layer
    # recompute, so the LoRA recipe recomputes whole layers (recipes/deepseek_v4_flash_lora.md, memory table).
    recompute_granularity: str | None = "full"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    recompute_modules: tuple[str, ...] = ()
    attention_chunk_threshold: int = 1024  # above this many tokens attention runs over query blocks
    attention_query_block: int = 256
    # MTP is built (its layer and loss sit on the last stage) but LoRA leaves it alone: the targets carry
    # mtp='exclude' (impl.MTP_POLICIES), since the main loss never trains it and PEFT/transformers has no MTP.
    include_mtp: bool = True
    checkpoint: str | None = None
    preset: str | None = None  # tiny variants: the tiny_models preset the qualify base is written from

    def __post_init__(self) -> None:
        m = self.model
        problems = []
        for name in ("nodes", "gpus_per_node", "tp", "pp", "ep", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if problems:
            raise UnsupportedConfigError(f"recipe for {m.name}: " + "; ".join(problems))
        world = self.world_size
        if world % (self.tp * self.pp):
            problems.append(
                f"world size {world} ({self.nodes} nodes x {self.gpus_per_node} GPUs) is not divisible by "
                f"TP*PP={self.tp * self.pp}; data parallelism must be a whole number"
            )
        elif world % (self.pp * self.ep):
            # megatron-core: world % (ETP * EP * PP) == 0 with expert TP = 1
            problems.append(
                f"world size {world} is not divisible by PP*EP={self.pp * self.ep} (expert-parallel groups)"
            )
        if m.num_experts % self.ep:
            problems.append(f"EP={self.ep} does not divide the {m.num_experts} routed experts of {m.name}")
        if m.num_heads % self.tp or m.o_groups % self.tp or m.vocab_size % self.tp:
            problems.append(
                f"TP={self.tp} must divide num_heads={m.num_heads}, o_groups={m.o_groups} and vocab={m.vocab_size}"
            )
        if not problems and self.global_batch_size % (self.micro_batch_size * self.data_parallel_size):
            problems.append(
                f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size*DP="
                f"{self.micro_batch_size}*{self.data_parallel_size}"
            )
        if not self.targets or any(t not in ATTENTION_TARGETS for t in self.targets):
            problems.append(f"targets {list(self.targets)} must be a non-empty subset of {list(ATTENTION_TARGETS)}")
        if self.lora_rank < 1 or self.lora_alpha <= 0 or not 0.0 <= self.lora_dropout < 1.0:
            problems.append(
                f"LoRA rank={self.lora_rank}, alpha={self.lora_alpha}, dropout={self.lora_dropout}: "
                "need rank >= 1, alpha > 0, 0 <= dropout < 1"
            )
        if problems:
            raise UnsupportedConfigError(
                f"recipe for {m.name} (TP={self.tp} PP={self.pp} EP={self.ep}, {world} ranks) is not runnable: "
                + "; ".join(problems)
                + ". Change the parallel sizes or the node count."
            )
        if len(self.pipeline_layout) != self.stages:
            raise UnsupportedConfigError(
                f"pipeline layout has {len(self.pipeline_layout)} stages but PP*VPP={self.stages}; regenerate it "
                "with impl.generate_pipeline_layout"
            )
        validate_pipeline_layout(
            self.pipeline_layout,
            num_layers=m.num_layers,
            num_hash_layers=m.num_hash_layers,
            mtp_layers=m.mtp_layers if self.include_mtp else 0,
        )

    def activation_plan(self) -> dict[str, Any]:
        """Keyword arguments of ``impl.ActivationPlan`` (and of the memory model) for this recipe."""
        return {
            "recompute_granularity": self.recompute_granularity,
            "recompute_method": self.recompute_method,
            "recompute_num_layers": self.recompute_num_layers,
            "recompute_modules": tuple(self.recompute_modules),
            "attention_chunk_threshold": self.attention_chunk_threshold,
            "attention_query_block": self.attention_query_block,
        }

    @property
    def expert_tensor_parallel_size(self) -> int:
        """1: the native experts are whole on their EP rank (never split over TP)."""
        return 1

    @property
    def context_parallel_size(self) -> int:
        """1: the native attention sees the whole sequence on every rank."""
        return 1

    @property
    def sequence_parallel(self) -> bool:
        """False: the native parallel linears run without sequence parallelism (impl.native.parallel)."""
        return False

    @property
    def packed_sequences(self) -> bool:
        """False: samples are unpacked ``[batch, seq]`` (SBHD upstream), never packed THD."""
        return False

    @property
    def params_dtype(self) -> torch.dtype:
        """The base weights' and adapters' dtype (also the pipeline's activation dtype)."""
        return torch.bfloat16 if self.optimizer.bf16 else torch.float32

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (self.pp * self.ep)

    @property
    def stages(self) -> int:
        return self.pp * (self.vpp or 1)

    @property
    def grad_accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def tiny_variant(self, **kwargs: Any) -> DeepseekV4LoRARecipe:
        return tiny_variant(self, **kwargs)


def _layout_for(model: ModelShape, stages: int, include_mtp: bool) -> Layout:
    return generate_pipeline_layout(
        model.num_layers,
        stages,
        num_hash_layers=model.num_hash_layers,
        mtp_layers=model.mtp_layers if include_mtp else 0,
    )


def _checkpoint_from_env() -> str | None:
    return os.environ.get(CHECKPOINT_ENV) or None


def deepseek_v4_flash_lora_recipe(
    *, nodes: int = 4, gpus_per_node: int = 8, tp: int = 1, pp: int = 4, ep: int = 8, vpp: int | None = None
) -> DeepseekV4LoRARecipe:
    """LoRA on DeepSeek-V4-Flash's five attention projections: 32 GPUs, TP=1 PP=4 EP=8 (DP derived = 8).

    The fused-kernel defaults are read from this host's GPU now (True on Blackwell, False elsewhere);
    the base checkpoint path comes from ``$DSV4_FLASH_CHECKPOINT``.

    Megatron-Bridge 0.6.2 ships DeepSeek-V4-Flash SFT recipes (``deepseek_v4_flash_sft_32gpu_h100_bf16_config``:
    TP=1, PP=4, EP=8, alltoall dispatcher, selective recompute ``moe_act``/``mhc``, Adam, bf16) but no LoRA/PEFT
    recipe; this one keeps the SFT parallel layout and adds the LoRA settings. The model shapes
    (:data:`FLASH_SHAPE`, :data:`PRO_SHAPE`, :data:`TINY_MODELS`) are data, in ``model_shapes.toml``.
    """
    if min(tp, pp, ep, vpp or 1) < 1:
        raise UnsupportedConfigError(f"parallel sizes must be >= 1, got TP={tp} PP={pp} EP={ep} VPP={vpp}")
    return DeepseekV4LoRARecipe(
        model=FLASH_SHAPE,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        tp=tp,
        pp=pp,
        ep=ep,
        vpp=vpp,
        pipeline_layout=_layout_for(FLASH_SHAPE, pp * (vpp or 1), include_mtp=True),
        fused=sft_fused_kernel_defaults(),
        checkpoint=_checkpoint_from_env(),
    )


def deepseek_v4_pro_lora_recipe(
    *, nodes: int = 16, gpus_per_node: int = 8, tp: int = 2, pp: int = 8, ep: int = 16
) -> DeepseekV4LoRARecipe:
    """The Flash recipe's LoRA settings on DeepSeek-V4-Pro: 128 GPUs, TP=2 PP=8 EP=16 (DP derived = 8).

    Why this layout (recipes/deepseek_v4_flash_lora.md, Pro memory table): the bf16 base is ~3.2 TB (almost all
    routed experts), so 16 nodes is the smallest count that holds it with room for activations: 8 stages of <= 8
    layers with the experts over 16 ranks leave ~30 GB of weights per rank. Pro's 128-head attention dominates a
    recomputed layer and stage 0 holds 8 micro-batches under 1F1B: the heaviest rank needs ~77 GB at TP=1, ~65 GB
    at TP=2 and ~59 GB at TP=4; TP=2 is the smallest that stays under 70 GB (fewer TP all-reduces, DP 8).
    """
    if min(tp, pp, ep) < 1:
        raise UnsupportedConfigError(f"parallel sizes must be >= 1, got TP={tp} PP={pp} EP={ep}")
    return DeepseekV4LoRARecipe(
        model=PRO_SHAPE,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        tp=tp,
        pp=pp,
        ep=ep,
        pipeline_layout=_layout_for(PRO_SHAPE, pp, include_mtp=True),
        fused=sft_fused_kernel_defaults(),
        global_batch_size=256,
    )


def tiny_variant(
    recipe: DeepseekV4LoRARecipe | None = None, *, preset: str = "tiny-tp", tp: int = 1, pp: int = 2, ep: int = 1
) -> DeepseekV4LoRARecipe:
    """The same recipe on a tiny preset and ``tp*pp*ep`` CPU ranks (default 2: TP=1, PP=2, EP=1).

    Kept: targets, LoRA rank/alpha/dropout, optimizer, dispatcher, recompute, MTP, the layout rule (generated,
    hash layers on stage 0, MTP + loss last) and the hardware gate (re-evaluated here). Changed: the model,
    node/GPU counts, batch (DP x 1 micro-batch x 2) and sequence length (the preset's shortest full-coverage one).
    """
    if preset not in TINY_MODELS:
        raise UnsupportedConfigError(f"no tiny model {preset!r}; the tiny variant runs on one of {sorted(TINY_MODELS)}")
    base = recipe or deepseek_v4_flash_lora_recipe()
    tiny = TINY_MODELS[preset]
    model = tiny.shape
    world = tp * pp * ep
    dp = world // (tp * pp)
    return replace(
        base,
        model=model,
        nodes=1,
        gpus_per_node=world,
        tp=tp,
        pp=pp,
        ep=ep,
        vpp=None,
        pipeline_layout=_layout_for(model, pp, base.include_mtp),
        fused=sft_fused_kernel_defaults(),
        micro_batch_size=1,
        global_batch_size=2 * dp,
        seq_length=tiny.seq_length,
        checkpoint=None,
        preset=preset,
    )


def to_qualify_args(
    recipe: DeepseekV4LoRARecipe, *, out: str = "out/qualify", steps: int = 3, seed: int = 0, timeout_s: float = 900.0
) -> list[str]:
    """``dsv4-lora`` argv (starting with ``qualify``) that runs the whole contract on this recipe's layout.

    A recipe with a checkpoint qualifies that base; a tiny variant lets qualify write its preset's base.
    qualify has no dropout/optimizer flags: it trains with dropout 0 so adapter logits are comparable exactly.
    A checkpoint recipe is full size, so it runs ``--no-oracle``: the transformers oracle of a whole Flash base
    would need several hundred GB on rank 0's host.
    """
    if recipe.vpp:
        raise UnsupportedConfigError(f"dsv4-lora qualify runs one chunk per rank; recipe has VPP={recipe.vpp}")
    if recipe.checkpoint:
        source = ["--base", recipe.checkpoint]
    elif recipe.preset:
        source = ["--preset", recipe.preset]
    else:
        raise UnsupportedConfigError(
            f"recipe for {recipe.model.name} has no checkpoint: set ${CHECKPOINT_ENV} to the official-layout "
            "checkpoint directory before building the recipe"
        )
    return [
        "qualify",
        *source,
        "--targets",
        ",".join(recipe.targets),
        "--rank",
        str(recipe.lora_rank),
        "--alpha",
        str(recipe.lora_alpha),
        "--tp",
        str(recipe.tp),
        "--pp",
        str(recipe.pp),
        "--ep",
        str(recipe.ep),
        "--nproc",
        str(recipe.world_size),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--timeout",
        str(timeout_s),
        "--out",
        str(out),
        *(["--no-oracle"] if recipe.checkpoint else []),
    ]

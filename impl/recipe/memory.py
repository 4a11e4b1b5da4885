"""Per-rank memory of a DeepSeek-V4 LoRA recipe: weights measured on the meta device, activations by formula.

Weights come from building each stage on the meta device (:func:`stage_weight_bytes`); activations from an analytic
model of what autograd keeps in one native decoder layer (:func:`layer_activation_bytes`; docs/memory_model.md lists
every term), checked against measured saved-tensor bytes by ``suites/reference/test_memory_model.py``. Pipeline and
recompute accounting: :func:`recipe_memory`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from impl.native.activations import ActivationPlan

__all__ = [
    "ActivationShape",
    "StageMemory",
    "format_memory_table",
    "layer_activation_bytes",
    "recipe_memory",
    "stage_activation_bytes",
]

GB = 1e9
#: the CUDA context, NCCL buffers and allocator slack
OVERHEAD_BYTES = int(4 * GB)
ADAPTER_BYTES_PER_ELEMENT = {2: 2 + 4 + 4 + 8, 4: 4 + 4 + 8}
FP32 = 4


@dataclass(frozen=True, kw_only=True)
class ActivationShape(ActivationPlan):
    """What one micro-batch on one rank looks like to the activation model: the shape, the adapters, and the
    activation plan it runs under (the plan's fields and checks, :class:`ActivationPlan`)."""

    micro_batch: int
    seq_len: int
    dtype_bytes: int = 2
    tp: int = 1
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
    lora_dropout: float = 0.0

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def _hc_site(cfg: Any, a: ActivationShape) -> int:
    """``hc_pre`` + ``hc_post`` at one site: fp32 flat/normed streams, Sinkhorn iterates, post/comb casts."""
    t, n, d, b = a.tokens, cfg.hc_mult, cfg.hidden_size, a.dtype_bytes
    post = t * d * b + t * n * b + t * n * n * b  # hc_post keeps f and the casts of post / comb
    return post + _hc_pre(cfg, a)


def _hc_pre(cfg: Any, a: ActivationShape) -> int:
    t, n, d, b = a.tokens, cfg.hc_mult, cfg.hidden_size, a.dtype_bytes
    if a.selective("mhc"):
        return 0
    # x.float() is a copy in bf16 (kept by the RMS product), the streams themselves in fp32; the normed copy feeds
    # the frozen hc_*_fn only, so nothing keeps it
    streams = t * n * d * FP32 if b < FP32 else 0
    iters = cfg.hc_sinkhorn_iters  # each division keeps its matrix and its column / row sums
    sinkhorn = t * FP32 * (2 * iters * n * n + 2 * iters * n + 2 * n + 1)
    return streams + sinkhorn


def _attention_core(cfg: Any, a: ActivationShape, entries: int, heads: int) -> int:
    """Scores, probabilities and the expanded keys, per query block (or once, eagerly)."""
    s, mb, b, hd = a.seq_len, a.micro_batch, a.dtype_bytes, cfg.head_dim
    chunked = a.uses_chunked_attention(s)
    blocks = (
        [(q0, min(s, q0 + a.attention_query_block)) for q0 in range(0, s, a.attention_query_block)]
        if chunked
        else [(0, s)]
    )
    total = 0
    for q0, q1 in blocks:
        rows = q1 - q0
        keys = (q1 - (max(0, q0 - cfg.window_size + 1) if chunked else 0)) + entries
        mask = (mb if entries else 1) * rows * keys  # bool; per sample only when entries are picked per sample
        if a.selective("core_attn"):
            total += mb * keys * hd * b + mask  # the checkpoint's inputs: the block's keys and mask
            continue
        # the shared keys: with one sample the matmuls fold (1, H) into the batch as a stride-0 view; with more,
        # torch materializes them expanded over heads, once as is and once transposed for q @ k^T
        expanded = 2 * mb * heads * keys * hd * b if mb > 1 else keys * hd * b
        probs = mb * heads * rows * ((keys + 1) * FP32 + (keys * b if b < FP32 else 0) + 8)
        total += expanded + probs + mask
    return total


def _attention(cfg: Any, layer: int | None, a: ActivationShape) -> int:
    t, b, d, hd = a.tokens, a.dtype_bytes, cfg.hidden_size, cfg.head_dim
    heads, groups = cfg.num_heads // a.tp, cfg.o_groups // a.tp
    q, r, lo = cfg.q_lora_rank, a.lora_rank, cfg.o_lora_rank
    ratio = 0 if layer is None else cfg.compress_ratios[layer]
    entries = a.seq_len // ratio if ratio else 0
    targets = set(a.lora_targets)
    total = t * q * FP32 + t * hd * FP32 + 2 * t * FP32  # q_norm's and kv_norm's fp32 copies and rsqrt
    total += t * heads * hd * (FP32 + (b if b < FP32 else 0))  # q's unweighted norm: fp32 copy and q itself
    total += t * heads * (FP32 + b)  # ... and its rsqrt, fp32 and cast
    total += 6 * a.micro_batch * a.seq_len * cfg.rope_head_dim * b  # cos / sin of q, kv and the output rotation
    total += t * heads * hd * b  # q after RoPE (kept by the score matmul or the checkpoint)
    total += _attention_core(cfg, a, entries, heads)
    if ratio:
        width = (2 if ratio == 4 else 1) * hd  # the CSA compressor's windows overlap
        total += t * width * (FP32 + 2 * b)  # softmax over the slots (fp32), slot values and weights
    lora_in = {"wq_a": d, "wkv": d, "wq_b": q, "wo_a": heads * hd, "wo_b": groups * lo}
    if targets & {"wq_a", "wkv"}:
        total += t * d * b  # the attention input, kept for the adapters' A gradients
    for name, width in lora_in.items():
        if name not in targets:
            continue
        if name != "wq_a" and name != "wkv":
            total += t * width * b
        total += t * r * b * (groups if name == "wo_a" else 1)  # x @ A^T, kept for B's gradient
        if a.lora_dropout > 0:
            total += t * width * (b + 1)  # the dropped-out copy and its mask
    return total


def _moe(cfg: Any, a: ActivationShape) -> int:
    t, b, d = a.tokens, a.dtype_bytes, cfg.hidden_size
    e, k, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    per_unit = (2 if a.selective("moe_act") else 5) * b  # fc1 output [, clamp / SiLU / product inputs]
    router = 2 * t * e * FP32 + t * k * (8 + 4 + 4) + t * FP32 + (e * d * FP32 if b < FP32 else 0)
    # balanced routing: T*k (token, expert) pairs per EP rank, each keeping its gathered input, the expert's
    # intermediates, its output (for the routing weight's product), that weight and its index
    routed = t * k * (inter * per_unit + 2 * d * b + 12)
    shared = t * inter * cfg.n_shared_experts * per_unit
    return router + routed + shared


def layer_activation_bytes(cfg: Any, layer: int | None, a: ActivationShape) -> dict[str, int]:
    """Bytes autograd keeps for one decoder layer (``layer=None``: the MTP layer, sliding) without full recompute."""
    t, n, d, b = a.tokens, cfg.hc_mult, cfg.hidden_size, a.dtype_bytes
    return {
        "streams": 2 * t * n * d * b,  # the layer's input streams and the FFN site's input streams
        "hyper_connections": 2 * _hc_site(cfg, a),
        "norms": 2 * t * d * FP32,
        "attention": _attention(cfg, layer, a),
        "moe": _moe(cfg, a),
    }


def first_layer_saving(cfg: Any, a: ActivationShape) -> int:
    """On the first stage the embedding is frozen, so the first layer's input streams need no gradient: its
    attention site's ``hc_pre`` and norm keep nothing (the LoRA adapters after them still keep their inputs)."""
    t, n, d, b = a.tokens, cfg.hc_mult, cfg.hidden_size, a.dtype_bytes
    return t * n * d * b + _hc_pre(cfg, a) + t * d * FP32


def head_activation_bytes(cfg: Any, a: ActivationShape) -> int:
    """The last stage's head: hc_head's fp32 streams, final norm, fp32 vocab-parallel cross-entropy."""
    t, n, d, b = a.tokens, cfg.hc_mult, cfg.hidden_size, a.dtype_bytes
    streams = t * n * d * b + (t * n * d * FP32 if b < FP32 else 0)  # the last layer's output and its fp32 copy
    small = t * (n * FP32 + FP32 + 32)  # pre weights, rsqrt, the cross-entropy's per-token masks and indices
    return streams + t * d * FP32 + t * (cfg.vocab_size // a.tp) * FP32 + small


def stage_activation_bytes(
    cfg: Any, layers: list[int | None], a: ActivationShape, *, first: bool, head: bool
) -> tuple[int, int]:
    """``(kept, transient)`` bytes of one micro-batch on a stage: kept until its backward; transient while a
    recomputed group runs again in backward. ``first``: the stage embeds; ``head``: it computes the loss."""
    per_layer = [sum(layer_activation_bytes(cfg, n, a).values()) for n in layers]
    if first and per_layer:
        per_layer[0] -= first_layer_saving(cfg, a)
    head_bytes = head_activation_bytes(cfg, a) if head else 0
    if a.recompute_granularity != "full":
        return sum(per_layer) + head_bytes, 0
    streams = a.tokens * cfg.hc_mult * cfg.hidden_size * a.dtype_bytes
    # the groups the model checkpoints (the plan's own rule): a recomputed group keeps only its input streams
    groups = a.checkpointed_layers(len(layers))
    recomputed = [g for g in groups if all(a.layer_is_recomputed(i) for i in g)]
    kept = sum(streams if g in recomputed else sum(per_layer[i] for i in g) for g in groups)
    return kept + head_bytes, 2 * max((sum(per_layer[i] for i in g) for g in recomputed), default=0)


# ------------------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class StageWeights:
    base: int  # this rank's frozen parameters and buffers
    adapter_elements: int
    experts: int  # the routed-expert part of ``base`` (this rank's 1/EP share)
    tp_split: int  # the TP-split part of ``base`` (this rank's 1/TP share)


def stage_weight_bytes(
    hf_config: Any, *, stage_tokens: list[str], layer_numbers: list[int], tp: int, ep: int, dtype: Any, lora: dict
) -> StageWeights:
    """Build one stage on the meta device and charge its tensors to a rank (experts / EP, TP-split / TP).

    The stage is built on ``torch.device("meta")`` (no memory) at TP = EP = 1 with the recipe's LoRA applied, then
    every tensor is charged to a rank: routed-expert tensors / EP, TP-split tensors / TP. Frozen base tensors cost
    their bytes only; each adapter element costs its bf16 value + fp32 ``main_grad`` + fp32 master + Adam's two fp32
    moments (2 + 4 + 4 + 8 = 18 bytes; 16 in an fp32 build, whose parameters are their own masters).
    """
    import torch

    from impl.lora.wrappers import apply_lora
    from impl.native.config import V4Config
    from impl.native.model import DeepseekV4NativeModel

    cfg = V4Config.from_hf(hf_config)
    with torch.device("meta"):
        model = DeepseekV4NativeModel(
            cfg,
            pre_process="embedding" in stage_tokens,
            post_process="loss" in stage_tokens,
            layer_numbers=layer_numbers,
            include_mtp="mtp" in stage_tokens,
            params_dtype=dtype,
        )
        handle = apply_lora(model, **lora) if layer_numbers else None
    base = adapters = experts = split = 0
    for _, p in model.named_parameters():
        share = p.numel()
        routed = getattr(p, "allreduce", True) is False  # routed experts
        tp_split = bool(getattr(p, "tensor_model_parallel", False))
        share //= ep if routed else 1
        share //= tp if tp_split else 1
        if p.requires_grad and handle is not None:
            adapters += share
            continue
        base += share * p.element_size()
        experts += share * p.element_size() if routed else 0
        split += share * p.element_size() if tp_split else 0
    base += sum(buf.numel() * buf.element_size() for buf in model.buffers())
    return StageWeights(base=base, adapter_elements=adapters, experts=experts, tp_split=split)


# --------------------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: tuple[int, ...]
    tokens: tuple[str, ...]
    base: int
    adapters: int  # parameters + fp32 grads + fp32 masters + Adam moments
    in_flight: int
    activations_no_recompute: int
    activations_recompute: int  # kept + transient under the recipe's recompute
    overhead: int = OVERHEAD_BYTES
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def total_no_recompute(self) -> int:
        return self.base + self.adapters + self.activations_no_recompute + self.overhead

    @property
    def total(self) -> int:
        return self.base + self.adapters + self.activations_recompute + self.overhead


def recipe_memory(hf_config: Any, recipe: Any) -> list[StageMemory]:
    """One row per pipeline stage (the heaviest rank of each stage) for ``recipe`` on ``hf_config``.

    Builds each stage's native graph with its LoRA on this process, so Megatron parallel state must be initialized
    (world size 1 is enough: the rows scale by the recipe's TP and EP themselves); Megatron-Bridge 0.4's LoRA reads
    the TP size from it.

    Weights: :func:`stage_weight_bytes`. Activations: :func:`layer_activation_bytes`, written op by op from
    ``impl/native``. A stage keeps the activations of ``min(PP - stage, micro-batches)`` micro-batches under a 1F1B
    schedule; full recompute keeps only each checkpointed group's input streams, plus, while a group is recomputed in
    backward, that group's activations and their gradients (counted as twice the largest layer's).
    :data:`OVERHEAD_BYTES` stands for the CUDA context, NCCL buffers and allocator slack."""
    import torch

    from impl.conversion.pipeline import stage_layer_numbers
    from impl.native.config import V4Config

    cfg = V4Config.from_hf(hf_config)
    dtype = torch.bfloat16 if recipe.optimizer.bf16 else torch.float32
    shape = ActivationShape(
        micro_batch=recipe.micro_batch_size,
        seq_len=recipe.seq_length,
        dtype_bytes=2 if recipe.optimizer.bf16 else 4,
        tp=recipe.tp,
        lora_rank=recipe.lora_rank,
        lora_targets=tuple(recipe.targets),
        lora_dropout=recipe.lora_dropout,
        **recipe.activation_plan(),
    )
    plain = ActivationShape(**{**shape.__dict__, "recompute_granularity": None, "recompute_modules": ()})
    lora = dict(targets=list(recipe.targets), rank=recipe.lora_rank, alpha=recipe.lora_alpha)
    micro_batches = recipe.grad_accumulation_steps
    rows = []
    for stage, tokens in enumerate(recipe.pipeline_layout):
        numbers = list(stage_layer_numbers(recipe.pipeline_layout, stage))
        weights = stage_weight_bytes(
            hf_config, stage_tokens=list(tokens), layer_numbers=numbers, tp=recipe.tp, ep=recipe.ep, dtype=dtype,
            lora=lora,
        )  # fmt: skip
        layers: list[int | None] = [*numbers, *([None] * cfg.num_mtp_layers if "mtp" in tokens else [])]
        in_flight = min(recipe.pp - stage % recipe.pp, micro_batches)
        head = "loss" in tokens
        first = "embedding" in tokens
        kept_plain, _ = stage_activation_bytes(cfg, layers, plain, first=first, head=head)
        kept, transient = stage_activation_bytes(cfg, layers, shape, first=first, head=head)
        rows.append(
            StageMemory(
                stage=stage,
                layers=tuple(numbers),
                tokens=tuple(str(t) for t in tokens),
                base=weights.base,
                adapters=weights.adapter_elements * ADAPTER_BYTES_PER_ELEMENT[shape.dtype_bytes],
                in_flight=in_flight,
                activations_no_recompute=in_flight * kept_plain,
                activations_recompute=in_flight * kept + transient,
                notes={
                    "adapter_elements": weights.adapter_elements,
                    "expert_bytes": weights.experts,
                    "tp_split_bytes": weights.tp_split,
                },
            )
        )
    return rows


def format_memory_table(rows: list[StageMemory]) -> str:
    """A markdown table in GB (1e9 bytes)."""
    head = (
        "| stage | layers | bf16 base | adapters+grads+Adam | in flight | activations (no recompute) | "
        "activations (recipe recompute) | overhead | total (no recompute) | total (recipe) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        span = f"{r.layers[0]}-{r.layers[-1]}" if r.layers else "-"
        extra = "".join(f" +{t}" for t in r.tokens if t in ("embedding", "mtp", "loss"))
        lines.append(
            f"| {r.stage} | {span}{extra} | {r.base / GB:.1f} | {r.adapters / GB:.2f} | {r.in_flight} | "
            f"{r.activations_no_recompute / GB:.1f} | {r.activations_recompute / GB:.1f} | {r.overhead / GB:.0f} | "
            f"{r.total_no_recompute / GB:.1f} | **{r.total / GB:.1f}** |"
        )
    return head + "\n".join(lines) + "\n"

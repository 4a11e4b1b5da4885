"""Seeded random tiny DeepSeek-V4 checkpoints in the OFFICIAL on-disk layout, and the transformers oracle.

``write_checkpoint`` builds a transformers ``DeepseekV4ForCausalLM``, re-initialises every tensor from a
seeded generator (including what transformers' init leaves degenerate: zero ``sinks`` / ``position_bias`` /
hc ``base`` / gate bias, unit norms and hc ``scale``, all-zero ``tid2eid``), renames it to the official
names (one table, below), splits the fused experts, adds the MTP block transformers does not model, and
writes ``config.json`` + ``model.safetensors``. ``load_oracle`` loads it back through transformers'
own conversion table and fails on any missing / unexpected key.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from tiny_models.errors import CheckpointLoadError, CheckpointNameError
from tiny_models.manifest import manifest, storage_dtype
from tiny_models.presets import get_preset

__all__ = [
    "GLOBAL_NAMES",
    "LAYER_NAMES",
    "EXPERT_NAMES",
    "official_to_transformers_name",
    "transformers_to_official_name",
    "build_random_model",
    "official_state_dict",
    "write_checkpoint",
    "load_oracle",
]

# THE name table: official on-disk name <-> transformers 5.12.1 state-dict name.
GLOBAL_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# Per-layer suffixes: official ``layers.{i}.<key>`` <-> transformers ``model.layers.{i}.<value>``.
LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# Routed experts: official ``layers.{i}.ffn.experts.{e}.<w>.weight`` is a slice of a fused transformers
# tensor: (fused name, which half of dim 1 or None). gate_up_proj is [E, 2I, d] = cat(w1, w3); down_proj [E, d, I].
EXPERT_NAMES: dict[str, tuple[str, int | None]] = {
    "w1": ("mlp.experts.gate_up_proj", 0),
    "w3": ("mlp.experts.gate_up_proj", 1),
    "w2": ("mlp.experts.down_proj", None),
}
_TF_TO_LAYER = {v: k for k, v in LAYER_NAMES.items()}
_TF_TO_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}
_OFFICIAL_LAYER = re.compile(r"^layers\.([0-9]+)\.(.+)$")
_OFFICIAL_EXPERT = re.compile(r"^ffn\.experts\.([0-9]+)\.(w[123])\.weight$")
_TF_LAYER = re.compile(r"^model\.layers\.([0-9]+)\.(.+)$")


def official_to_transformers_name(name: str) -> str:
    """The transformers state-dict name holding official tensor ``name``.

    A routed-expert weight maps to its fused tensor (``...mlp.experts.gate_up_proj`` / ``down_proj``);
    ``EXPERT_NAMES`` says which slice. ``mtp.*`` has no transformers counterpart and is rejected.
    """
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = _OFFICIAL_LAYER.match(name)
    if match:
        layer, rest = match.groups()
        if rest in LAYER_NAMES:
            return f"model.layers.{layer}.{LAYER_NAMES[rest]}"
        expert = _OFFICIAL_EXPERT.match(rest)
        if expert:
            return f"model.layers.{layer}.{EXPERT_NAMES[expert.group(2)][0]}"
    hint = " (transformers does not model MTP)" if name.startswith("mtp.") else ""
    raise CheckpointNameError(
        f"official tensor name {name!r} has no transformers counterpart{hint}; "
        "known names are in tiny_models.oracle.GLOBAL_NAMES / LAYER_NAMES / EXPERT_NAMES"
    )


def transformers_to_official_name(name: str) -> str:
    """The official on-disk name of transformers state-dict entry ``name`` (1:1 entries only).

    The fused ``mlp.experts.gate_up_proj`` / ``down_proj`` hold ``E`` official tensors each and are
    rejected; ``official_state_dict`` splits them.
    """
    if name in _TF_TO_GLOBAL:
        return _TF_TO_GLOBAL[name]
    match = _TF_LAYER.match(name)
    if match and match.group(2) in _TF_TO_LAYER:
        return f"layers.{match.group(1)}.{_TF_TO_LAYER[match.group(2)]}"
    fused = " (a fused expert tensor: split it with official_state_dict)" if ".mlp.experts." in name else ""
    raise CheckpointNameError(
        f"transformers tensor name {name!r} has no 1:1 official name{fused}; "
        "known names are in tiny_models.oracle.GLOBAL_NAMES / LAYER_NAMES"
    )


def _resolve(cfg_or_preset: DeepseekV4Config | str) -> DeepseekV4Config:
    return get_preset(cfg_or_preset) if isinstance(cfg_or_preset, str) else cfg_or_preset


def _random_value(name: str, shape: tuple[int, ...], cfg: DeepseekV4Config, gen: torch.Generator) -> torch.Tensor:
    """A non-degenerate random value for tensor ``name`` (official or transformers naming) of ``shape``.

    Linear weights ~ N(0, 1/fan_in) so activations stay O(1); norm weights in [0.5, 1.5] so a wrong
    norm pairing shows; sinks, ape, hc base/scale and the gate bias random so their paths matter;
    ``tid2eid`` rows are distinct valid expert ids.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        rows, k = shape
        scores = torch.rand(rows, cfg.n_routed_experts, generator=gen)
        return scores.argsort(dim=-1)[:, :k].contiguous().to(torch.int64)  # a random k-subset per token
    if leaf in ("attn_sink", "sinks"):
        return torch.randn(shape, generator=gen)
    if leaf in ("ape", "position_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if leaf in ("bias", "e_score_correction_bias"):  # gate bias: large enough to change some top-k picks
        return 0.5 * torch.randn(shape, generator=gen)
    if leaf in ("base", "hc_base") or name.endswith(("_base",)):
        return 0.5 * torch.randn(shape, generator=gen)
    if leaf in ("scale", "hc_scale") or name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=gen)
    if len(shape) == 1:  # every remaining 1-D tensor is an RMSNorm weight
        return 0.5 + torch.rand(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


@torch.no_grad()
def build_random_model(cfg_or_preset: DeepseekV4Config | str, *, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A fp32, eval-mode transformers model whose every persistent tensor comes from ``seed``.

    The global torch RNG is left untouched.
    """
    cfg = _resolve(cfg_or_preset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    # Parameters and persistent buffers, in state-dict order (deterministic).
    for name, tensor in model.state_dict(keep_vars=True).items():
        value = _random_value(name, tuple(tensor.shape), cfg, gen)
        tensor.data.copy_(value.to(tensor.dtype))
    return model.eval()


def official_state_dict(
    model: DeepseekV4ForCausalLM, *, seed: int = 0, dtype: torch.dtype = torch.float32, include_mtp: bool = True
) -> dict[str, torch.Tensor]:
    """``model``'s tensors under official names (experts split), plus seeded ``mtp.*`` tensors, in
    their official storage dtypes (weights in ``dtype``; fp32 families fp32; ``tid2eid`` int64)."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = _TF_LAYER.match(name)
        fused = match.group(2) if match else None
        if fused in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            layer, inter = match.group(1), cfg.moe_intermediate_size
            for e in range(tensor.shape[0]):
                for w, (tf_name, half) in EXPERT_NAMES.items():
                    if tf_name != fused:
                        continue
                    part = tensor[e] if half is None else tensor[e, half * inter : (half + 1) * inter]
                    out[f"layers.{layer}.ffn.experts.{e}.{w}.weight"] = part
            continue
        out[transformers_to_official_name(name)] = tensor
    if include_mtp:
        # transformers has no MTP module: draw it from the manifest's shapes with its own seeded stream.
        gen = torch.Generator().manual_seed(seed + 0x6D7470)
        for spec in manifest(cfg, include_mtp=True):
            if spec.name.startswith("mtp."):
                out[spec.name] = _random_value(spec.name, spec.shape, cfg, gen)
    return {name: t.detach().to(storage_dtype(name, dtype)).contiguous().clone() for name, t in out.items()}


def write_checkpoint(
    cfg_or_preset: DeepseekV4Config | str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (official layout) of a seeded random model.

    Same ``(config, seed, dtype)`` -> byte-identical files. Returns ``out_dir``.
    """
    cfg = _resolve(cfg_or_preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_random_model(cfg, seed=seed)
    tensors = official_state_dict(model, seed=seed, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = DeepseekV4Config.from_dict(cfg.to_dict())
    config.architectures = ["DeepseekV4ForCausalLM"]
    config.dtype = dtype
    config.to_json_file(str(out / "config.json"), use_diff=False)
    return out


def load_oracle(ckpt_dir: str | Path) -> DeepseekV4ForCausalLM:
    """Load an official-layout checkpoint with transformers (fp32, eval); raise on any key problem
    other than the ``mtp.*`` tensors transformers deliberately ignores."""
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32, output_loading_info=True)
    problems = {
        kind: sorted(str(k) for k in info.get(kind, ()) if not str(k).startswith("mtp."))
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        raise CheckpointLoadError(
            f"transformers could not load {ckpt_dir} cleanly: {problems}; "
            "the checkpoint's names or shapes disagree with transformers' deepseek_v4 conversion table"
        )
    return model.eval()

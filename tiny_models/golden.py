"""The oracle side of the golden vectors (``golden/``, written by ``scripts/golden_vectors.py``).

A tiny DeepSeek-V4 base (sliding, CSA with compressor + indexer, HCA; ``o_groups`` 2), seeded adapters on each of
the five main attention targets in every layer, seeded inputs, and what PEFT on transformers' ``DeepseekV4ForCausalLM``
computes from them: each adapted projection and each layer's attention block. Nothing here comes from the
implementation; the three namings are written out below from the published module paths.

Every value an engine loads (base weights, LoRA factors, inputs) is bfloat16-exact, so an engine holding them in
bfloat16 holds the very values the float32 reference used, and a difference is its own arithmetic.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask

from tiny_models.presets import CSA, HCA, SLIDING, min_seq_len, tiny_config

__all__ = [
    "ADAPTER_FILE",
    "CONFIG_FILE",
    "INPUT_OF",
    "NAMINGS",
    "TARGETS",
    "adapter_config",
    "adapter_tensors",
    "attention_block",
    "factors",
    "golden_config",
    "grouped_lora_hook",
    "inputs",
    "io_shapes",
    "module_path",
    "peft_model",
    "projection",
    "write_adapter",
]

#: a couple of layers of every attention kind, every shape small and distinct enough that a transposed or
#: misrouted tensor cannot fit; ``o_groups`` 2 so the grouped ``wo_a`` has groups to confuse
CONFIG_FIELDS: dict[str, object] = {
    "layer_types": [SLIDING, CSA, HCA],
    "num_hash_layers": 1,
    "hca_rate": 8,
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "head_dim": 16,
    "qk_rope_head_dim": 4,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 8,
    "sliding_window": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 2,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 5,
    "num_nextn_predict_layers": 1,
}
BASE_SEED, ADAPTER_SEED, INPUT_SEED = 7, 1000, 2000
RANK, ALPHA = 4, 8.0
#: lora_B's size: the delta then rivals the base projection (as in the engines' numerics check), so every defect
#: below moves the outputs by a good fraction of their size
B_SCALE = 0.2
TARGETS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
#: transformers' leaf of each target under ``model.layers.N.self_attn``
TRANSFORMERS_LEAF = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
#: naming -> (module path format, whether its leaf is transformers' or the official checkpoint's): PEFT on
#: transformers; the official checkpoint (vLLM); SGLang's module tree with the checkpoint's leaves
NAMINGS: dict[str, tuple[str, bool]] = {
    "transformers": ("model.layers.{layer}.self_attn.{leaf}", True),
    "official": ("layers.{layer}.attn.{leaf}", False),
    "sglang": ("model.layers.{layer}.self_attn.{leaf}", False),
}
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
#: the input tensor (in inputs.safetensors) each projection and the attention block ("attn") reads
INPUT_OF = {
    "wq_a": "hidden_states",
    "wkv": "hidden_states",
    "wq_b": "q_residual",
    "wo_a": "o_grouped",
    "wo_b": "o_flat",
    "attn": "hidden_states",
}


def golden_config() -> DeepseekV4Config:
    return tiny_config(**copy.deepcopy(CONFIG_FIELDS))


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def io_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target's weight; wo_a's in_features is one group's."""
    heads = cfg.num_attention_heads * cfg.head_dim
    return {
        "wq_a": (cfg.q_lora_rank, cfg.hidden_size),
        "wq_b": (heads, cfg.q_lora_rank),
        "wkv": (cfg.head_dim, cfg.hidden_size),
        "wo_a": (cfg.o_groups * cfg.o_lora_rank, heads // cfg.o_groups),
        "wo_b": (cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank),
    }


def inputs(cfg: DeepseekV4Config) -> dict[str, torch.Tensor]:
    """One sequence long enough for every layer kind (the indexer's top-k really selects), positions from 0."""
    t = min_seq_len(cfg)
    g = torch.Generator().manual_seed(INPUT_SEED)
    heads = cfg.num_attention_heads * cfg.head_dim
    shapes = {
        "hidden_states": (1, t, cfg.hidden_size),
        "q_residual": (1, t, cfg.q_lora_rank),
        "o_grouped": (1, t, cfg.o_groups, heads // cfg.o_groups),
        "o_flat": (1, t, cfg.o_groups * cfg.o_lora_rank),
    }
    out = {name: _bf16_exact(torch.randn(shape, generator=g)) for name, shape in shapes.items()}
    out["position_ids"] = torch.arange(t, dtype=torch.int64).unsqueeze(0)
    return out


def factors(cfg: DeepseekV4Config, target: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (lora_A [r, in], lora_B [out, r]) of ``target``'s adapter: its own seed, every layer different."""
    out_f, in_f = io_shapes(cfg)[target]
    g = torch.Generator().manual_seed(ADAPTER_SEED + TARGETS.index(target))
    found = {}
    for layer in range(cfg.num_hidden_layers):
        a = torch.randn(RANK, in_f, generator=g) / in_f**0.5
        b = torch.randn(out_f, RANK, generator=g) * B_SCALE
        found[layer] = (_bf16_exact(a), _bf16_exact(b))
    return found


def module_path(naming: str, layer: int, target: str) -> str:
    template, transformers_leaf = NAMINGS[naming]
    return template.format(layer=layer, leaf=TRANSFORMERS_LEAF[target] if transformers_leaf else target)


def adapter_tensors(
    naming: str, target: str, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    out = {}
    for layer, (a, b) in layers.items():
        module = PEFT_PREFIX + module_path(naming, layer, target)
        out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.contiguous(), b.contiguous()
    return out


def adapter_config(naming: str, target: str, *, rslora: bool = False) -> dict[str, object]:
    """PEFT's LoRA config. transformers: an exact regex, so the compressors' ``kv_proj`` and the indexer's
    ``q_b_proj`` (same leaves) are never wrapped; official / sglang: the leaf list vLLM and SGLang read."""
    if naming == "transformers":
        targets: object = rf"model\.layers\.[0-9]+\.self_attn\.{TRANSFORMERS_LEAF[target]}"
    else:
        targets = [target]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "fan_in_fan_out": False,
        "use_rslora": rslora,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def write_adapter(out: Path, naming: str, target: str, layers, *, rslora: bool = False) -> Path:
    """``adapter_model.safetensors`` + ``adapter_config.json`` as PEFT's ``save_pretrained`` lays them out."""
    out.mkdir(parents=True, exist_ok=True)
    # one metadata key: safetensors writes a map's keys in no fixed order, and the files must be byte-stable
    save_file(adapter_tensors(naming, target, layers), str(out / ADAPTER_FILE), metadata={"format": "pt"})
    text = json.dumps(adapter_config(naming, target, rslora=rslora), indent=2, sort_keys=True) + "\n"
    (out / CONFIG_FILE).write_text(text)
    return out


def peft_model(base: DeepseekV4ForCausalLM, adapter_dir: Path):
    """PEFT's own reload of ``adapter_dir`` onto a copy of ``base``; raises unless it took every tensor as stored."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()
    params = dict(model.named_parameters())
    for key, value in load_file(str(adapter_dir / ADAPTER_FILE)).items():
        loaded = params.get(key.replace(".weight", ".default.weight"))
        if loaded is None or not torch.equal(loaded.detach(), value):
            raise AssertionError(f"PEFT did not load {key} of {adapter_dir} as stored")
    return model


def _decoder(model):
    """transformers' ``DeepseekV4Model`` inside ``model`` (a ``PeftModel`` or the causal LM itself)."""
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).model


def projection(model, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
    """``target``'s module of ``layer`` on ``x`` (a PEFT-wrapped module runs PEFT's own LoRA forward)."""
    with torch.no_grad():
        return getattr(_decoder(model).layers[layer].self_attn, TRANSFORMERS_LEAF[target])(x)


@torch.no_grad()
def attention_block(model, layer: int, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``layer``'s ``self_attn`` called exactly as ``DeepseekV4Model.forward`` calls it on a first forward: a fresh
    cache, the sliding-window causal mask, both rotary tables."""
    inner = _decoder(model)
    cache = DynamicCache(config=inner.config)
    mask = create_sliding_window_causal_mask(
        config=inner.config,
        inputs_embeds=hidden,
        attention_mask=None,
        past_key_values=cache,
        position_ids=position_ids,
    )
    rope = {kind: inner.rotary_emb(hidden, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
    out, _ = inner.layers[layer].self_attn(
        hidden, position_embeddings=rope, position_ids=position_ids, attention_mask=mask, past_key_values=cache
    )
    return out


def grouped_lora_hook(a: torch.Tensor, b: torch.Tensor, scale: float, groups: int) -> Callable:
    """A forward hook adding wo_a's LoRA unmerged, by the grouped definition: every group's input through the one
    lora_A, group g through its own rows of lora_B (a second computation of what PEFT's merge gives)."""
    per_group = b.view(groups, b.shape[0] // groups, b.shape[1])

    def hook(module, args, out):
        shrunk = torch.einsum("...gk,rk->...gr", args[0], a)
        return out + scale * torch.einsum("...gr,gor->...go", shrunk, per_group)

    return hook

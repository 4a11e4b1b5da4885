"""A tiny DeepSeek-V4.1-shaped base: a config.json and a safetensors header set written from the published facts
(docs/deepseek_v41.md), not from any V4.1 code (no transformers release has one). It is the input of the tests that
prove every command names V4.1 as V4.1 instead of misreading it as V4.

Shapes are tiny but keep V4.1's structure: a nested ``text_config`` + ``vision_config``, the five attention
projections under their V4 names, ``indexer.wk`` / ``indexer.k_norm``, Engram on layers 1 and 14 of the real model
(layer 1 here), ``ffn.gate.bias_vl``, three DSpark MTP layers, no ``tid2eid`` and no ``hc_head``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["V41_SPELLINGS", "write_v41_base"]

#: (architectures[0], model_type): the released spelling and the earlier one SGLang's config loader accepts
V41_SPELLINGS = (
    ("DeepseekV41ForCausalLM", "deepseek_v41"),
    ("DeepseekV41ForConditionalGeneration", "deepseek_v4.1"),
)

_HIDDEN, _Q_RANK, _HEADS, _HEAD_DIM, _GROUPS, _O_RANK, _LAYERS = 64, 32, 2, 32, 2, 16, 3


def _text_config(model_type: str) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": _LAYERS,
        "q_lora_rank": _Q_RANK,
        "num_attention_heads": _HEADS,
        "head_dim": _HEAD_DIM,
        "o_groups": _GROUPS,
        "o_lora_rank": _O_RANK,
        "vocab_size": 256,
        "n_routed_experts": 4,
        "num_nextn_predict_layers": 3,
        "compress_ratios": [0, 1, 2, 0, 0, 0],
        "kv_source_layer_ids": [0],
        "rms_norm_eps": 1e-20,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"},
    }


def _tensors() -> dict[str, torch.Tensor]:
    z = torch.zeros
    out = {"embed.weight": z(256, _HIDDEN), "head.weight": z(256, _HIDDEN), "norm.weight": z(_HIDDEN)}
    for n in range(_LAYERS):
        a = f"layers.{n}.attn"
        out |= {
            f"{a}.wq_a.weight": z(_Q_RANK, _HIDDEN),
            f"{a}.wq_b.weight": z(_HEADS * _HEAD_DIM, _Q_RANK),
            f"{a}.wkv.weight": z(_HEAD_DIM, _HIDDEN),
            f"{a}.wo_a.weight": z(_GROUPS * _O_RANK, _HEADS * _HEAD_DIM // _GROUPS),
            f"{a}.wo_b.weight": z(_HIDDEN, _GROUPS * _O_RANK),
            f"{a}.attn_sink": z(_HEADS),
            f"{a}.indexer.wk.weight": z(16, _HIDDEN),
            f"{a}.indexer.k_norm.weight": z(16),
            f"layers.{n}.ffn.gate.weight": z(4, _HIDDEN),
            f"layers.{n}.ffn.gate.bias_vl": z(4),
        }
    out |= {"layers.1.engram.wkv.weight": z(_HEAD_DIM, _HIDDEN), "layers.1.engram.embed.weight": z(64, _HIDDEN)}
    for m in range(3):
        out[f"mtp.{m}.main_proj.weight"] = z(_HIDDEN, 2 * _HIDDEN)
    out["vision.patch_embed.weight"] = z(_HIDDEN, 48)
    return out


def write_v41_base(out: str | Path, architecture: str, model_type: str) -> Path:
    """Write the tiny V4.1-shaped base to ``out`` in the given spelling; returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = _text_config(model_type)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": _HIDDEN, "patch_size": 4},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_tensors(), out / "model.safetensors", metadata={"format": "pt"})
    return out

"""THE checkpoint-name table: official DeepSeek-V4 on-disk names <-> native Megatron names, in two layouts.

One row per tensor family. ``*`` stands for one whole dotted segment of digits (a layer, MTP or
expert index), as in Megatron-Bridge. Gated rows map one native tensor to two official tensors
(gate = ``w1``, up = ``w3``; native ``linear_fc1 = cat(w1, w3)``). Official expert indices are
global; the native name carries the *local* expert index (the bridge renumbers, EP rank ``r`` holds
global experts ``r*E/ep .. (r+1)*E/ep-1``). MTP rows are generated from the per-layer template
(``mtp.K.<suffix>`` <-> ``mtp.layers.K.mtp_model_layer.<suffix>``, sliding-only, score-routed).

Semantics (the Megatron-Bridge mapping class built for the row, see :data:`SEMANTICS`):

============================  ===========================  =================================================
semantics                     Megatron-Bridge class        meaning
============================  ===========================  =================================================
``replicated``                ``ReplicatedMapping``        whole tensor on every TP rank
``column``                    ``ColumnParallelMapping``    split on dim 0 over TP (heads / o-groups / sink)
``row``                       ``RowParallelMapping``       split on dim 1 over TP
``vocab``                     ``ColumnParallelMapping``    vocab rows split over TP (padded to the shard)
``auto``                      ``AutoMapping``              parallelism read from the native module class
``gated_mlp``                 ``GatedMLPMapping``          native ``[w1; w3]``, gate/up split per TP shard
``replicated_gated_mlp``      ``GatedMLPMapping``          native ``[w1; w3]`` on every TP rank (TP group unset)
``expert_gated_mlp``          ``GatedMLPMapping``          as above, per expert, EP-gathered on export
``expert_row``                ``RowParallelMapping``       ``w2`` per expert (expert-TP), EP-gathered
============================  ===========================  =================================================

The rows are :data:`_LAYER_TEMPLATE` (one :class:`LayerRow` per decoder-layer family, prefixed for the decoder
and the MTP layer) and the few model-level rows of :func:`_build_table`. Each row also carries its ``upstream``
name(s): upstream Megatron-Core's ``dsv4_hybrid`` graph, the layout Megatron-Bridge's ``DeepSeekV4Bridge`` maps onto
(names only: the semantics describe the Miles graph, the one this implementation builds). ``dsv4-lora coverage
--manifest flash`` prints every official name with the native name and semantics it maps to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from impl.errors import MappingTableError

__all__ = [
    "GATED_ROLES",
    "GROUPS",
    "MAPPING_TABLE",
    "SEMANTICS",
    "MappingRow",
    "MappingTableError",
    "expected_official_names",
]

SEMANTICS = (
    "replicated",
    "column",
    "row",
    "vocab",
    "auto",
    "gated_mlp",
    "replicated_gated_mlp",
    "expert_gated_mlp",
    "expert_row",
)
GROUPS = (
    "embedding",
    "norm",
    "attention",
    "attention_sink",
    "hyper_connection",
    "compressor",
    "indexer",
    "routing",
    "expert",
    "shared_expert",
    "mtp",
)
GATED_ROLES = ("gate", "up")


@dataclass(frozen=True)
class MappingRow:
    """One tensor family: official pattern(s), native (Miles) pattern, upstream-Megatron pattern(s), parallel
    semantics (of the Miles graph), group."""

    official: str | tuple[str, str]  # a (gate, up) pair for gated rows
    native: str
    upstream: str | tuple[str, ...]  # a tuple: one official tensor split over several upstream parameters
    semantics: str
    group: str
    note: str = ""

    @property
    def official_names(self) -> tuple[str, ...]:
        return self.official if isinstance(self.official, tuple) else (self.official,)

    @property
    def upstream_names(self) -> tuple[str, ...]:
        return self.upstream if isinstance(self.upstream, tuple) else (self.upstream,)

    def layout_names(self, layout: str) -> tuple[str, ...]:
        """This row's pattern(s) in the native layout ``layout`` ("miles" or "upstream")."""
        return (self.native,) if layout == "miles" else self.upstream_names

    @property
    def is_gated(self) -> bool:
        return isinstance(self.official, tuple)

    @property
    def is_mtp(self) -> bool:
        return self.native.startswith("mtp.")

    @property
    def is_expert(self) -> bool:
        return self.semantics.startswith("expert_")

    def hf_param(self) -> str | dict[str, str]:
        """The Megatron-Bridge ``hf_param`` argument: a name, or ``{"gate": .., "up": ..}``."""
        return dict(zip(GATED_ROLES, self.official, strict=True)) if self.is_gated else self.official


# Upstream Megatron-Core names (the ``dsv4_hybrid`` layout Megatron-Bridge's DeepSeekV4Bridge maps onto) where they
# differ from the Miles ones: attention projections get MLA names, CSA parts live under ``core_attention``,
# hyper-connections are modules, routed experts are one grouped GEMM per layer (``weight<E>``, global E).
_HC_MODULE = {"attn": "self_attention_hyper_connection", "ffn": "mlp_hyper_connection"}
_HC_PARAM = {"fn": "mapping_proj.weight", "base": "bias", "scale": ("alpha_pre", "alpha_post", "alpha_res")}
_CSA_PARAM = {
    "ape": "ape",
    "wkv.weight": "linear_wkv.weight",
    "wgate.weight": "linear_wgate.weight",
    "norm.weight": "norm.weight",
}


def _hc_upstream(site: str, p: str) -> str | tuple[str, ...]:
    param = _HC_PARAM[p]
    parts = param if isinstance(param, tuple) else (param,)
    names = tuple(f"{_HC_MODULE[site]}.{x}" for x in parts)
    return names if isinstance(param, tuple) else names[0]


_CORE = "self_attention.core_attention"


@dataclass(frozen=True)
class LayerRow:
    """One tensor family of a decoder layer, as suffixes after ``layers.*.`` (official) / ``decoder.layers.*.``
    (native, upstream); :func:`_build_table` prefixes it for the decoder and, where ``in_mtp``, for the MTP layer."""

    official: str | tuple[str, str]  # a (gate, up) pair for gated rows
    native: str
    upstream: str | tuple[str, ...]
    semantics: str
    group: str
    in_mtp: bool  # the MTP layer has this tensor too
    note: str = ""
    hash_layers: bool | None = None  # only in hash-routed layers (True), only in score-routed ones (False)


_LAYER_TEMPLATE: tuple[LayerRow, ...] = (
    LayerRow("attn_norm.weight", "input_layernorm.weight", "input_layernorm.weight", "replicated", "norm", True),
    LayerRow("ffn_norm.weight", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight", "replicated", "norm", True),
    *(
        LayerRow(
            official=f"hc_{site}_{p}",
            native=f"hc_{site}_{p}",
            upstream=_hc_upstream(site, p),
            semantics="replicated",
            group="hyper_connection",
            in_mtp=True,
            note="fp32",
        )
        for site in ("attn", "ffn")
        for p in ("fn", "base", "scale")
    ),
    LayerRow(
        official="attn.attn_sink",
        native="self_attention.attn_sink",
        upstream=f"{_CORE}.attn_sink",
        semantics="column",
        group="attention_sink",
        in_mtp=True,
        note="fp32, one per head",
    ),
    LayerRow(
        official="attn.wq_a.weight",
        native="self_attention.wq_a.weight",
        upstream="self_attention.linear_q_down_proj.weight",
        semantics="replicated",
        group="attention",
        in_mtp=True,
    ),
    LayerRow(
        official="attn.q_norm.weight",
        native="self_attention.q_norm.weight",
        upstream="self_attention.q_layernorm.weight",
        semantics="replicated",
        group="norm",
        in_mtp=True,
    ),
    LayerRow(
        official="attn.wq_b.weight",
        native="self_attention.wq_b.weight",
        upstream="self_attention.linear_q_up_proj.weight",
        semantics="column",
        group="attention",
        in_mtp=True,
        note="split by heads",
    ),
    LayerRow(
        official="attn.wkv.weight",
        native="self_attention.wkv.weight",
        upstream="self_attention.linear_kv_proj.weight",
        semantics="replicated",
        group="attention",
        in_mtp=True,
    ),
    LayerRow(
        official="attn.kv_norm.weight",
        native="self_attention.kv_norm.weight",
        upstream="self_attention.kv_layernorm.weight",
        semantics="replicated",
        group="norm",
        in_mtp=True,
    ),
    LayerRow(
        official="attn.wo_a.weight",
        native="self_attention.wo_a.weight",
        upstream="self_attention.linear_o_group_proj",  # a raw nn.Parameter upstream, not a module
        semantics="column",
        group="attention",
        in_mtp=True,
        note="split by output groups",
    ),
    LayerRow(
        official="attn.wo_b.weight",
        native="self_attention.wo_b.weight",
        upstream="self_attention.linear_proj.weight",
        semantics="row",
        group="attention",
        in_mtp=True,
    ),
    *(
        LayerRow(
            official=f"attn.compressor.{p}",
            native=f"self_attention.compressor.{p}",
            upstream=f"{_CORE}.compressor.{up}",
            semantics="replicated",
            group="compressor",
            in_mtp=False,
            note="ratio > 0",
        )
        for p, up in _CSA_PARAM.items()
    ),
    LayerRow(
        official="attn.indexer.wq_b.weight",
        native="self_attention.indexer.linear_wq_b.weight",
        upstream=f"{_CORE}.indexer.linear_wq_b.weight",
        semantics="replicated",
        group="indexer",
        in_mtp=False,
        note="ratio 4",
    ),
    LayerRow(
        official="attn.indexer.weights_proj.weight",
        native="self_attention.indexer.linear_weights_proj.weight",
        upstream=f"{_CORE}.indexer.linear_weights_proj.weight",
        semantics="replicated",
        group="indexer",
        in_mtp=False,
        note="ratio 4",
    ),
    *(
        LayerRow(
            official=f"attn.indexer.compressor.{p}",
            native=f"self_attention.indexer.compressor.{p}",
            upstream=f"{_CORE}.indexer.compressor.{up}",
            semantics="replicated",
            group="indexer",
            in_mtp=False,
            note="ratio 4",
        )
        for p, up in _CSA_PARAM.items()
    ),
    LayerRow("ffn.gate.weight", "mlp.router.weight", "mlp.router.weight", "replicated", "routing", True),
    LayerRow(
        official="ffn.gate.bias",
        native="mlp.router.expert_bias",
        upstream="mlp.router.expert_bias",
        semantics="replicated",
        group="routing",
        in_mtp=True,
        note="fp32, score-routed layers",
        hash_layers=False,
    ),
    LayerRow(
        official="ffn.gate.tid2eid",
        native="mlp.router.tid2eid",
        upstream="mlp.router.tid2eid",
        semantics="replicated",
        group="routing",
        in_mtp=False,
        note="int64 buffer, hash layers",
        hash_layers=True,
    ),
    LayerRow(
        official=("ffn.experts.*.w1.weight", "ffn.experts.*.w3.weight"),
        native="mlp.experts.local_experts.*.linear_fc1.weight",
        upstream="mlp.experts.linear_fc1.weight*",
        semantics="expert_gated_mlp",
        group="expert",
        in_mtp=True,
        note="global expert index in the official name, local in the native one",
    ),
    LayerRow(
        official="ffn.experts.*.w2.weight",
        native="mlp.experts.local_experts.*.linear_fc2.weight",
        upstream="mlp.experts.linear_fc2.weight*",
        semantics="expert_row",
        group="expert",
        in_mtp=True,
        note="global expert index in the official name, local in the native one",
    ),
    LayerRow(
        official=("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
        native="mlp.shared_experts.linear_fc1.weight",
        upstream="mlp.shared_experts.linear_fc1.weight",
        semantics="replicated_gated_mlp",
        group="shared_expert",
        in_mtp=True,
        note="replicated over TP (impl.native.moe)",
    ),
    LayerRow(
        official="ffn.shared_experts.w2.weight",
        native="mlp.shared_experts.linear_fc2.weight",
        upstream="mlp.shared_experts.linear_fc2.weight",
        semantics="replicated",
        group="shared_expert",
        in_mtp=True,
        note="replicated over TP (impl.native.moe)",
    ),
)


def _prefixed(prefix: str, names: Any) -> Any:
    if isinstance(names, tuple):
        return tuple(prefix + n for n in names)
    return prefix + names


def _build_table() -> tuple[MappingRow, ...]:
    rows: list[MappingRow] = [
        MappingRow(
            "embed.weight", "embedding.word_embeddings.weight", "embedding.word_embeddings.weight", "vocab", "embedding"
        ),
        MappingRow("head.weight", "output_layer.weight", "output_layer.weight", "vocab", "embedding"),
        MappingRow(
            "norm.weight", "decoder.final_layernorm.weight", "decoder.final_layernorm.weight", "replicated", "norm"
        ),
        *(
            MappingRow(
                f"hc_head_{p}",
                f"decoder.hc_head_params.hc_head_{p}",
                f"decoder.hc_head_{p}",
                "replicated",
                "hyper_connection",
                "fp32",
            )
            for p in ("fn", "base", "scale")
        ),
    ]
    for t in _LAYER_TEMPLATE:
        rows.append(
            MappingRow(
                official=_prefixed("layers.*.", t.official),
                native=f"decoder.layers.*.{t.native}",
                upstream=_prefixed("decoder.layers.*.", t.upstream),
                semantics=t.semantics,
                group=t.group,
                note=t.note,
            )
        )
    # MTP: generated from the same template, so a per-layer fix reaches the MTP layer too.
    for t in _LAYER_TEMPLATE:
        if t.in_mtp:
            first = t.official if isinstance(t.official, str) else t.official[0]
            rows.append(
                MappingRow(
                    official=_prefixed("mtp.*.", t.official),
                    native=f"mtp.layers.*.mtp_model_layer.{t.native}",
                    upstream=_prefixed("mtp.layers.*.mtp_model_layer.", t.upstream),
                    semantics=t.semantics,
                    group=t.group,
                    note=f"MTP copy of layers.*.{first}" + (f"; {t.note}" if t.note else ""),
                )
            )
    rows += [
        *(
            MappingRow(
                f"mtp.*.{leaf}.weight", f"mtp.layers.*.{mod}.weight", f"mtp.layers.*.{mod}.weight", "replicated", "mtp"
            )
            for leaf, mod in (
                ("enorm", "enorm"),
                ("hnorm", "hnorm"),
                ("norm", "final_layernorm"),
                ("e_proj", "e_proj"),
                ("h_proj", "h_proj"),
            )
        ),
        *(
            MappingRow(
                f"mtp.*.hc_head_{p}",
                f"mtp.layers.*.hc_head_params.hc_head_{p}",
                f"mtp.layers.*.hc_head_{p}",
                "replicated",
                "mtp",
                "fp32",
            )
            for p in ("fn", "base", "scale")
        ),
    ]
    return tuple(rows)


MAPPING_TABLE: tuple[MappingRow, ...] = _build_table()

# --------------------------------------------------------------------------------------------------
# the official manifest a configuration implies (what coverage calls "expected")


@dataclass(frozen=True)
class ManifestFacts:
    """What decides a checkpoint's tensor names: the layer count and schedule, experts and MTP layers."""

    num_layers: int
    compress_ratios: tuple[int, ...]
    num_hash_layers: int
    n_routed_experts: int
    num_mtp_layers: int

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @classmethod
    def from_published(cls, config: Mapping[str, Any]) -> ManifestFacts | None:
        """Read from a ``config.json`` that states its schedule in DeepSeek's published keys (``compress_ratios``,
        one per layer plus the MTP entry, and ``num_hash_layers``), without transformers (importing it costs
        seconds); None for any other form, which transformers' ``DeepseekV4Config`` folds."""
        try:
            layers, ratios = config["num_hidden_layers"], config["compress_ratios"]
            facts = cls(
                num_layers=layers,
                compress_ratios=tuple(ratios[:layers]),
                num_hash_layers=config["num_hash_layers"],
                n_routed_experts=config["n_routed_experts"],
                num_mtp_layers=config.get("num_nextn_predict_layers") or 0,
            )
        except (KeyError, TypeError):
            return None
        numbers = (facts.num_layers, facts.num_hash_layers, facts.n_routed_experts, facts.num_mtp_layers)
        plain = all(type(v) is int and v >= 0 for v in (*numbers, *facts.compress_ratios))
        return facts if plain and len(facts.compress_ratios) == layers else None


def _cfg(config: Any) -> Any:
    """Accept a native ``V4Config``, a transformers config or a ``config.json`` dict."""
    if hasattr(config, "compress_ratios") and hasattr(config, "num_hash_layers"):
        return config
    from impl.native.config import V4Config

    if isinstance(config, Mapping):
        facts = ManifestFacts.from_published(config)
        if facts is not None:
            return facts
        from transformers import DeepseekV4Config

        config = DeepseekV4Config(**dict(config))
    return V4Config.from_hf(config)


def _layer_names(prefix: str, ratio: int, hash_layer: bool, n_experts: int, in_mtp: bool) -> Iterator[str]:
    for t in _LAYER_TEMPLATE:
        if in_mtp and not t.in_mtp:
            continue
        if t.group == "compressor" and ratio == 0:
            continue
        if t.group == "indexer" and ratio != 4:
            continue
        if t.hash_layers is not None and t.hash_layers != hash_layer:
            continue
        names = t.official if isinstance(t.official, tuple) else (t.official,)
        if t.group == "expert":
            for e in range(n_experts):
                yield from (prefix + n.replace("*", str(e)) for n in names)
        else:
            yield from (prefix + n for n in names)


def expected_official_names(config: Any, *, with_mtp: bool = True) -> list[str]:
    """Every official (non-scale) tensor name a checkpoint of this configuration holds, in table order."""
    cfg = _cfg(config)
    names = ["embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
    for i in range(cfg.num_layers):
        names += _layer_names(
            f"layers.{i}.", cfg.compress_ratios[i], cfg.is_hash_layer(i), cfg.n_routed_experts, in_mtp=False
        )
    if with_mtp:
        for k in range(cfg.num_mtp_layers):
            p = f"mtp.{k}."
            names += _layer_names(p, 0, False, cfg.n_routed_experts, in_mtp=True)
            names += [p + s for s in ("enorm.weight", "hnorm.weight", "norm.weight", "e_proj.weight", "h_proj.weight")]
            names += [f"{p}hc_head_{s}" for s in ("fn", "base", "scale")]
    return names

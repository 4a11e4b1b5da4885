"""Naming dialects of a portable DeepSeek-V4 LoRA adapter: ONE table drives all three.

The five attention targets of V4 (native Megatron leaf under ``self_attention``) and their names in

* ``transformers`` (default): ``base_model.model.model.layers.N.self_attn.<hf leaf>.lora_{A,B}.weight``,
  loadable with ``peft.PeftModel.from_pretrained`` on transformers' ``DeepseekV4ForCausalLM``;
* ``official``: ``base_model.model.layers.N.attn.<official leaf>.lora_{A,B}.weight`` (checkpoint names, what
  vLLM's V4 LoRA expects; MTP is ``mtp.0.attn.<leaf>``);
* ``sglang``: ``base_model.model.model.layers.N.self_attn.<official leaf>.lora_{A,B}.weight`` (the Miles
  rollout path).

MTP: transformers has no MTP module and SGLang serves MTP as a separate draft model whose LoRA path is
unverified, so those dialects declare MTP unsupported (``mtp_reason``); the exporter then rejects MTP
adapters unless the caller asks to exclude them (the exclusion is recorded in the adapter's metadata).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from impl.adapter.upstream_names import miles_adapter_name
from impl.errors import ExportError

#: Prefix PEFT puts in front of every module name in ``adapter_model.safetensors``.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class TargetRow:
    native: str  # leaf under ``self_attention`` in the native Megatron graph
    official: str  # leaf under ``attn`` in the official checkpoint (also SGLang / vLLM module leaf)
    transformers: str  # leaf under ``self_attn`` in transformers' DeepseekV4ForCausalLM
    grouped: bool  # block-diagonal (grouped) forward: PEFT's unmerged forward is wrong, merge instead


#: The table. Order is the canonical export order.
TARGETS: tuple[TargetRow, ...] = (
    TargetRow("wq_a", "wq_a", "q_a_proj", False),
    TargetRow("wq_b", "wq_b", "q_b_proj", False),
    TargetRow("wkv", "wkv", "kv_proj", False),
    TargetRow("wo_a", "wo_a", "o_a_proj", True),
    TargetRow("wo_b", "wo_b", "o_b_proj", False),
)
TARGET_BY_NATIVE: dict[str, TargetRow] = {row.native: row for row in TARGETS}


@dataclass(frozen=True)
class Dialect:
    name: str
    layer_module: str  # format string with {layer} and {leaf}: module path relative to the base model
    leaf_column: str  # which TargetRow column names the leaf
    mtp_module: str | None  # format string with {leaf}, or None when the dialect has no MTP
    mtp_reason: str  # why MTP is unsupported (empty when supported)
    target_modules_style: str  # "regex": a PEFT fullmatch regex; "leaves": the list of leaf names (vLLM/SGLang)

    def leaf(self, row: TargetRow) -> str:
        return getattr(row, self.leaf_column)

    def module_name(self, layer: int | None, row: TargetRow) -> str:
        """Module path (relative to the base model, no PEFT prefix); ``layer=None`` is the MTP layer."""
        if layer is None:
            if self.mtp_module is None:
                raise ExportError(f"dialect {self.name!r} has no MTP module: {self.mtp_reason}")
            return self.mtp_module.format(leaf=self.leaf(row))
        return self.layer_module.format(layer=layer, leaf=self.leaf(row))

    def target_modules(self, modules: list[str]) -> str | list[str]:
        """``adapter_config.json`` ``target_modules`` that selects exactly ``modules`` (relative module paths)."""
        if self.target_modules_style == "leaves":
            rows = {m.rsplit(".", 1)[1] for m in modules}
            return [self.leaf(r) for r in TARGETS if self.leaf(r) in rows]
        # PEFT: a str target_modules is re.fullmatch'ed against every module path of the base model; an exact
        # alternation of the exported paths can therefore never also wrap compressor.kv_proj or indexer.q_b_proj.
        by_layer: dict[str, set[str]] = {}
        for m in modules:
            parent, leaf = m.rsplit(".", 1)
            by_layer.setdefault(parent, set()).add(leaf)
        groups: dict[frozenset[str], list[str]] = {}
        for parent, leaves in by_layer.items():
            groups.setdefault(frozenset(leaves), []).append(parent)
        alternatives = []
        for leaves, parents in sorted(groups.items(), key=lambda kv: _natural_key(kv[1][0])):
            parent_alt = "|".join(re.escape(p) for p in sorted(parents, key=_natural_key))
            leaf_alt = "|".join(sorted(re.escape(leaf) for leaf in leaves))
            alternatives.append(f"(?:{parent_alt})\\.(?:{leaf_alt})")
        return "^(?:" + "|".join(alternatives) + ")$"


DIALECTS: dict[str, Dialect] = {
    "transformers": Dialect(
        name="transformers",
        layer_module="model.layers.{layer}.self_attn.{leaf}",
        leaf_column="transformers",
        mtp_module=None,
        mtp_reason="transformers' DeepseekV4ForCausalLM has no MTP layer",
        target_modules_style="regex",
    ),
    "official": Dialect(
        name="official",
        layer_module="layers.{layer}.attn.{leaf}",
        leaf_column="official",
        mtp_module="mtp.0.attn.{leaf}",
        mtp_reason="",
        target_modules_style="leaves",
    ),
    "sglang": Dialect(
        name="sglang",
        layer_module="model.layers.{layer}.self_attn.{leaf}",
        leaf_column="official",
        mtp_module=None,
        mtp_reason="SGLang serves MTP as a separate draft model whose LoRA loading is unverified",
        target_modules_style="leaves",
    ),
}

_NATIVE_RE = re.compile(
    r"^(?:decoder\.layers\.(?P<layer>[0-9]+)|(?P<mtp>mtp\.layers\.0\.mtp_model_layer))"
    r"\.self_attention\.(?P<leaf>[A-Za-z0-9_]+)\.adapter\.(?P<half>linear_in|linear_out)\.weight$"
)


@dataclass(frozen=True)
class NativeAdapterName:
    layer: int | None  # None: the MTP layer
    row: TargetRow
    half: str  # "A" (linear_in) or "B" (linear_out)

    @property
    def module_key(self) -> tuple[int, int, str]:
        """Sort/identity key of the adapted module: MTP after all decoder layers."""
        return (1 if self.layer is None else 0, -1 if self.layer is None else self.layer, self.row.native)


def parse_native(name: str) -> NativeAdapterName:
    """Parse a Megatron-Bridge LoRA parameter name of the native V4 graph (raises ExportError naming it).

    A name in the upstream Megatron-Core layout is read as its Miles equivalent (one mapping table, see
    :mod:`impl.adapter.upstream_names`)."""
    m = _NATIVE_RE.match(miles_adapter_name(name) or name)
    if m is None:
        raise ExportError(
            f"adapter tensor {name!r} is not a native V4 attention LoRA parameter "
            "(expected decoder.layers.N.self_attention.<wq_a|wq_b|wkv|wo_a|wo_b>.adapter.linear_{in,out}.weight); "
            "only the five main-attention targets are exportable"
        )
    row = TARGET_BY_NATIVE.get(m["leaf"])
    if row is None:
        raise ExportError(
            f"adapter tensor {name!r} targets {m['leaf']!r}, which is not one of the exportable V4 attention "
            f"targets {[r.native for r in TARGETS]}"
        )
    layer = None if m["mtp"] else int(m["layer"])
    return NativeAdapterName(layer, row, "A" if m["half"] == "linear_in" else "B")


def official_base_name(layer: int | None, row: TargetRow) -> str:
    """The official checkpoint name of the base weight an adapter targets (what the fingerprint records)."""
    return DIALECTS["official"].module_name(layer, row) + ".weight"


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]

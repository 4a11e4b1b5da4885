"""Naming dialects of a portable DeepSeek-V4 LoRA adapter: one target table drives all three.

Each :class:`Dialect` names the attention targets of :data:`impl.vocabulary.TARGET_TABLE` the way one consumer loads
them; names translate both ways (:meth:`Dialect.module_name`, :func:`resolve_module`, :func:`parse_native`).
Only main-attention rows are exportable. A dialect without MTP makes the exporter reject MTP adapters unless the
caller excludes them, and the exclusion is recorded in the adapter's metadata."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from functools import cache

from impl.adapter.upstream_names import miles_adapter_name
from impl.errors import ExportError
from impl.vocabulary import ATTENTION_SCOPE, TARGET_TABLE, TargetRow, TargetTable

__all__ = [
    "DIALECTS",
    "match_native",
    "parse_native",
    "resolve_module",
    "translate_module",
]

#: Prefix PEFT puts in front of every module name in ``adapter_model.safetensors``.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Dialect:
    """How one consumer names the V4 attention targets; :data:`DIALECTS` holds the three.

    * ``transformers`` (default): ``base_model.model.model.layers.N.self_attn.<hf leaf>.lora_{A,B}.weight``,
      loadable with ``peft.PeftModel.from_pretrained`` on transformers' ``DeepseekV4ForCausalLM``;
    * ``official``: ``base_model.model.layers.N.attn.<official leaf>.lora_{A,B}.weight``: checkpoint names, what
      vLLM's V4 LoRA expects; MTP is ``mtp.0.attn.<leaf>``;
    * ``sglang``: ``base_model.model.model.layers.N.self_attn.<official leaf>.lora_{A,B}.weight``, the Miles
      rollout path.

    There is no ``vllm`` dialect: vLLM reads the ``official`` names. Its loader passes every LoRA tensor name through
    the model's ``hf_to_vllm_mapper`` (``vllm/lora/utils.py:parse_fine_tuned_lora_name`` with the rename-only
    ``WeightsMapper.get_rename_mapper()``), whose prefix rule ``layers.`` -> ``model.layers.`` turns
    ``layers.N.attn.<leaf>`` into vLLM's own module path ``model.layers.N.attn.<leaf>``. Its leaves are the official
    ones, and ``packed_modules_mapping`` packs ``wq_a`` + ``wkv`` from those same names. A name written the vLLM way
    would load identically, so a fourth dialect would add nothing; what vLLM does not apply (``wo_a``, MTP) no naming
    changes (see :mod:`impl.adapter.consumers`). ``suites/reference/test_consumers.py`` checks the official names land
    on vLLM's modules.

    MTP: transformers has no MTP module, and SGLang serves MTP as a separate draft model whose LoRA path is
    unverified, so those dialects declare MTP unsupported (``mtp_reason``).
    """

    name: str
    layer_module: str  # format string with {layer} and {leaf}: module path relative to the base model
    leaf_column: str  # which TargetRow column names the leaf
    mtp_module: str | None  # format string with {leaf}, or None when the dialect has no MTP
    mtp_reason: str  # why MTP is unsupported (empty when supported)
    target_modules_style: str  # "regex": a PEFT fullmatch regex; "leaves": the consumer module names (vLLM/SGLang)

    def leaf(self, row: TargetRow) -> str:
        return getattr(row, self.leaf_column)

    def module_name(self, layer: int | None, row: TargetRow) -> str:
        """Module path (relative to the base model, no PEFT prefix); ``layer=None`` is the MTP layer."""
        if layer is None:
            if self.mtp_module is None:
                raise ExportError(f"dialect {self.name!r} has no MTP module: {self.mtp_reason}")
            return self.mtp_module.format(leaf=self.leaf(row))
        return self.layer_module.format(layer=layer, leaf=self.leaf(row))

    def parse_module(self, path: str, table: TargetTable = TARGET_TABLE) -> tuple[int | None, TargetRow] | None:
        """Inverse of :meth:`module_name`: ``(layer, row)`` (``layer=None``: MTP), or None if not a target here."""
        for template in (self.layer_module, self.mtp_module):
            m = _template_regex(template).fullmatch(path) if template else None
            row = table.by_column(self.leaf_column).get(m["leaf"]) if m else None
            if row is not None:
                return (int(m["layer"]) if template == self.layer_module else None), row
        return None

    def target_modules(self, modules: list[str], table: TargetTable = TARGET_TABLE) -> str | list[str]:
        """``adapter_config.json`` ``target_modules`` that selects exactly ``modules`` (relative module paths)."""
        if self.target_modules_style == "leaves":
            hits = [self.parse_module(m, table) for m in modules]
            present = {hit[1].native for hit in hits if hit is not None}
            return [row.consumer for row in table.rows if row.native in present]
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


@cache
def _template_regex(template: str) -> re.Pattern[str]:
    """A module-path template (``{layer}``, ``{leaf}`` fields) as an anchored regex with named groups."""
    groups = {"layer": "(?P<layer>[0-9]+)", "leaf": "(?P<leaf>.+)"}
    return re.compile(
        "".join(
            re.escape(text) + (groups[name] if name else "") for text, name, _, _ in string.Formatter().parse(template)
        )
    )


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

_NATIVE_PREFIX = (
    r"^(?:decoder\.layers\.(?P<layer>[0-9]+)|(?P<mtp>mtp\.layers\.0\.mtp_model_layer))\."
    + re.escape(ATTENTION_SCOPE)
    + r"\."
)
_NATIVE_SUFFIX = r"\.adapter\.(?P<half>linear_in|linear_out)\.weight$"
#: any attention LoRA parameter name, exportable or not (to name the target in the error)
_ANY_NATIVE = re.compile(_NATIVE_PREFIX + r"(?P<leaf>[A-Za-z0-9_.]+?)" + _NATIVE_SUFFIX)


@cache
def native_adapter_regex(table: TargetTable = TARGET_TABLE) -> re.Pattern[str]:
    """The Megatron-Bridge LoRA parameter names of the table's exportable (main-attention) targets."""
    leaves = sorted((row.native for row in table.main), key=len, reverse=True)
    return re.compile(_NATIVE_PREFIX + "(?P<leaf>" + "|".join(map(re.escape, leaves)) + ")" + _NATIVE_SUFFIX)


@dataclass(frozen=True)
class NativeAdapterName:
    layer: int | None  # None: the MTP layer
    row: TargetRow
    half: str  # "A" (linear_in) or "B" (linear_out)

    @property
    def module_key(self) -> tuple[int, int, str]:
        """Sort/identity key of the adapted module: MTP after all decoder layers."""
        return (1 if self.layer is None else 0, -1 if self.layer is None else self.layer, self.row.native)


def match_native(name: str, table: TargetTable = TARGET_TABLE) -> NativeAdapterName | None:
    """A native V4 attention LoRA parameter name of an exportable target, parsed; None for any other name.

    A name in the upstream Megatron-Core layout is read as its Miles equivalent (one mapping table, see
    :mod:`impl.adapter.upstream_names`)."""
    m = native_adapter_regex(table).match(miles_adapter_name(name) or name)
    if m is None or not table.main:
        return None
    row = table.by_column("native")[m["leaf"]]
    return NativeAdapterName(None if m["mtp"] else int(m["layer"]), row, "A" if m["half"] == "linear_in" else "B")


def parse_native(name: str, table: TargetTable = TARGET_TABLE) -> NativeAdapterName:
    """Parse a Megatron-Bridge LoRA parameter name of the native V4 graph (raises ExportError naming it)."""
    parsed = match_native(name, table)
    if parsed is not None:
        return parsed
    exportable = [row.native for row in table.main]
    loose = _ANY_NATIVE.match(name)
    if loose is None:
        raise ExportError(
            f"adapter tensor {name!r} is not a native V4 attention LoRA parameter (expected "
            f"decoder.layers.N.{ATTENTION_SCOPE}.<{'|'.join(exportable)}>.adapter.linear_{{in,out}}.weight); "
            "only the main-attention targets are exportable"
        )
    raise ExportError(
        f"adapter tensor {name!r} targets {loose['leaf']!r}, which is not one of the exportable V4 attention "
        f"targets {exportable}"
    )


def native_adapter_name(name: str) -> str:
    """Strip DDP/Float16 ``module.`` prefixes and ``.to_wrap`` hops from a LoRA parameter name."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name.replace(".to_wrap.", ".")


def native_name(layer: int | None, row: TargetRow, half: str) -> str:
    """Inverse of :func:`parse_native`: the native (Miles layout) LoRA parameter name of half ``"A"`` or ``"B"``."""
    scope = "mtp.layers.0.mtp_model_layer" if layer is None else f"decoder.layers.{layer}"
    return f"{scope}.{ATTENTION_SCOPE}.{row.native}.adapter.{'linear_in' if half == 'A' else 'linear_out'}.weight"


@dataclass(frozen=True)
class ModuleRef:
    """A PEFT module path read back: which dialect wrote it, the layer (None: MTP) and the target."""

    dialect: str
    layer: int | None
    row: TargetRow

    @property
    def official_weight(self) -> str:
        return official_base_name(self.layer, self.row)


def resolve_module(path: str, table: TargetTable = TARGET_TABLE) -> ModuleRef | None:
    """The target a module path (relative to the base model, any dialect) names; None if it names none."""
    for dialect in DIALECTS.values():
        hit = dialect.parse_module(path, table)
        if hit is not None:
            return ModuleRef(dialect.name, *hit)
    return None


def translate_module(path: str, dialect: str, table: TargetTable = TARGET_TABLE) -> str | None:
    """``path`` (any dialect) written in ``dialect``; None if it names no target or ``dialect`` cannot name it."""
    ref = resolve_module(path, table)
    if ref is None or (ref.layer is None and DIALECTS[dialect].mtp_module is None):
        return None
    return DIALECTS[dialect].module_name(ref.layer, ref.row)


def official_base_name(layer: int | None, row: TargetRow) -> str:
    """The official checkpoint name of the base weight an adapter targets (what the fingerprint records)."""
    return DIALECTS["official"].module_name(layer, row) + ".weight"


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]

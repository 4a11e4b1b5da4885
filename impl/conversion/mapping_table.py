"""THE checkpoint-name table: official DeepSeek-V4 on-disk names <-> native Megatron names, in two layouts.

One row per tensor family, read from ``mapping_table.toml`` beside this module; ``*`` stands for one dotted segment
of digits, as in Megatron-Bridge. Each row names the Megatron-Bridge mapping class it is converted with
(:data:`SEMANTICS`) and its upstream Megatron-Core names. ``dsv4-lora coverage --manifest flash`` prints every row.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from impl.data_tables import checked_keys, read_table_file
from impl.errors import MappingTableError, UnsupportedConfigError

__all__ = [
    "GATED_ROLES",
    "GROUPS",
    "MAPPING_TABLE",
    "SEMANTICS",
    "MappingRow",
    "MappingTableError",
    "expected_official_names",
]

#: How a row is converted: the Megatron-Bridge mapping class built for it.
#:
#: ``replicated`` (ReplicatedMapping): whole tensor on every TP rank. ``column`` (ColumnParallelMapping): split on
#: dim 0 over TP (heads, o-groups, sink). ``row`` (RowParallelMapping): split on dim 1. ``vocab``
#: (ColumnParallelMapping): vocab rows split over TP, padded to the shard. ``auto`` (AutoMapping): parallelism read
#: from the native module class. ``gated_mlp`` (GatedMLPMapping): native ``[w1; w3]``, gate/up split per TP shard;
#: ``replicated_gated_mlp``: the same on every TP rank; ``expert_gated_mlp``: per expert, EP-gathered on export.
#: ``expert_row`` (RowParallelMapping): ``w2`` per expert (expert-TP), EP-gathered.
#:
#: Gated rows map one native tensor to two official ones (gate ``w1``, up ``w3``; native ``linear_fc1 =
#: cat(w1, w3)``). Official expert indices are global; the native name carries the local index (EP rank ``r`` holds
#: global experts ``r*E/ep .. (r+1)*E/ep-1``; the bridge renumbers).
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


TABLE_FILE = Path(__file__).with_name("mapping_table.toml")
_NAME_KEYS = frozenset({"official", "native", "upstream", "semantics", "group"})
# per kind of row: (required keys, optional keys)
_ROW_KEYS = {
    "model": (_NAME_KEYS, frozenset({"note"})),
    "layer": (_NAME_KEYS | {"in_mtp"}, frozenset({"note", "hash_layers"})),
    "mtp": (_NAME_KEYS, frozenset({"note"})),
}


def _names(value: Any, key: str, where: str, *, pair: bool) -> str | tuple[str, ...]:
    """A name, or a TOML array of names as a tuple (``official``: exactly a (gate, up) pair)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value) and (len(value) == 2 if pair else value):
        return tuple(value)
    wanted = "a name or a [gate, up] pair of names" if pair else "a name or a non-empty array of names"
    raise MappingTableError(f"{where}: {key} must be {wanted}, got {value!r}")


def _row_fields(entry: Any, kind: str, where: str) -> dict[str, Any]:
    """The keyword arguments of a :class:`MappingRow` / :class:`LayerRow` for one TOML row, keys and types checked."""
    required, optional = _ROW_KEYS[kind]
    checked_keys(entry, where, MappingTableError, required=required, optional=optional)
    for key in ("native", "semantics", "group", "note"):
        if not isinstance(entry.get(key, ""), str):
            raise MappingTableError(f"{where}: {key} must be a string, got {entry[key]!r}")
    for key in ("in_mtp", "hash_layers"):
        if not isinstance(entry.get(key, False), bool):
            raise MappingTableError(f"{where}: {key} must be true or false, got {entry[key]!r}")
    official = _names(entry["official"], "official", where, pair=True)
    return {**entry, "official": official, "upstream": _names(entry["upstream"], "upstream", where, pair=False)}


def _load_rows(path: Path) -> tuple[tuple[MappingRow, ...], tuple[LayerRow, ...], tuple[MappingRow, ...]]:
    """The ``[[model]]``, ``[[layer]]`` and ``[[mtp]]`` rows of ``path``, in file order."""
    data = read_table_file(path, MappingTableError)
    if unknown := sorted(set(data) - set(_ROW_KEYS)):
        raise MappingTableError(f"{path.name}: unknown tables {unknown}; rows are [[model]], [[layer]], [[mtp]]")
    rows: dict[str, list[Any]] = {}
    for kind in _ROW_KEYS:
        entries = data.get(kind, [])
        if not isinstance(entries, list):
            raise MappingTableError(f"{path.name}: {kind} must be an array of [[{kind}]] tables")
        rows[kind] = []
        for i, entry in enumerate(entries, 1):
            name = entry.get("official", "?") if isinstance(entry, dict) else "?"
            fields = _row_fields(entry, kind, f"{path.name}: [[{kind}]] row {i} ({name!r})")
            rows[kind].append(LayerRow(**fields) if kind == "layer" else MappingRow(**fields))
    return tuple(rows["model"]), tuple(rows["layer"]), tuple(rows["mtp"])


_MODEL_ROWS, _LAYER_TEMPLATE, _MTP_ROWS = _load_rows(TABLE_FILE)


def _prefixed(prefix: str, names: Any) -> Any:
    if isinstance(names, tuple):
        return tuple(prefix + n for n in names)
    return prefix + names


def _placed(t: LayerRow, official_prefix: str, native_prefix: str, note: str) -> MappingRow:
    """Layer row ``t`` prefixed for one place (the decoder layers or the MTP layer)."""
    return MappingRow(
        official=_prefixed(official_prefix, t.official),
        native=native_prefix + t.native,
        upstream=_prefixed(native_prefix, t.upstream),
        semantics=t.semantics,
        group=t.group,
        note=note,
    )


def _build_table() -> tuple[MappingRow, ...]:
    """The model-level ``[[model]]`` rows, each ``[[layer]]`` row (a :class:`LayerRow`) prefixed for the decoder and,
    where ``in_mtp``, for the MTP layer (``mtp.K.<suffix>`` <-> ``mtp.layers.K.mtp_model_layer.<suffix>``,
    sliding-only, score-routed), and the MTP layer's own ``[[mtp]]`` rows. The ``upstream`` names are upstream
    Megatron-Core's ``dsv4_hybrid`` graph, which Megatron-Bridge's ``DeepSeekV4Bridge`` maps onto (names only: the
    semantics describe the Miles graph this implementation builds)."""
    rows = list(_MODEL_ROWS)
    rows += [_placed(t, "layers.*.", "decoder.layers.*.", t.note) for t in _LAYER_TEMPLATE]
    # MTP: generated from the same template, so a per-layer fix reaches the MTP layer too.
    for t in _LAYER_TEMPLATE:
        if t.in_mtp:
            first = t.official if isinstance(t.official, str) else t.official[0]
            note = f"MTP copy of layers.*.{first}" + (f"; {t.note}" if t.note else "")
            rows.append(_placed(t, "mtp.*.", "mtp.layers.*.mtp_model_layer.", note))
    rows += _MTP_ROWS
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
    from impl.native.config import V4Config  # up a floor: the one reading of a V4 config (plain Python)

    if isinstance(config, Mapping):
        facts = ManifestFacts.from_published(config)
        if facts is not None:
            return facts
        from transformers import DeepseekV4Config

        try:
            return V4Config.from_hf(DeepseekV4Config(**dict(config)))
        except Exception as exc:  # transformers' validators raise their own classes: a config.json it cannot build
            raise UnsupportedConfigError(
                f"the config is not a DeepSeek-V4 config.json transformers can build ({type(exc).__name__}: {exc}); "
                "pass the model's published config.json unchanged"
            ) from exc
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
    names = [name for row in _MODEL_ROWS for name in row.official_names]
    for i in range(cfg.num_layers):
        names += _layer_names(
            f"layers.{i}.", cfg.compress_ratios[i], cfg.is_hash_layer(i), cfg.n_routed_experts, in_mtp=False
        )
    if with_mtp:
        for k in range(cfg.num_mtp_layers):
            p = f"mtp.{k}."
            names += _layer_names(p, 0, False, cfg.n_routed_experts, in_mtp=True)
            names += [name.replace("mtp.*.", p, 1) for row in _MTP_ROWS for name in row.official_names]
    return names

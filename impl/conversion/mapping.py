"""THE checkpoint-name table: official DeepSeek-V4 on-disk names <-> native ("Miles-native") Megatron names.

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

Rows (``layers.*.`` <-> ``decoder.layers.*.``; ``mtp`` = also generated for the MTP layer):

======================================  ===============================================  ==========  ================  ===
official                                native                                           semantics   group             mtp
======================================  ===============================================  ==========  ================  ===
``embed.weight``                        ``embedding.word_embeddings.weight``             vocab       embedding
``head.weight``                         ``output_layer.weight``                          vocab       embedding
``norm.weight``                         ``decoder.final_layernorm.weight``               replicated  norm
``hc_head_{fn,base,scale}``             ``decoder.hc_head_params.hc_head_{...}``         replicated  hyper_connection
``layers.*.attn_norm.weight``           ``...input_layernorm.weight``                    replicated  norm              yes
``layers.*.ffn_norm.weight``            ``...pre_mlp_layernorm.weight``                  replicated  norm              yes
``layers.*.hc_{attn,ffn}_{fn,base,scale}``  ``...hc_{attn,ffn}_{fn,base,scale}``         replicated  hyper_connection  yes
``layers.*.attn.attn_sink``             ``...self_attention.attn_sink``                  column      attention_sink    yes
``layers.*.attn.wq_a.weight``           ``...self_attention.wq_a.weight``                replicated  attention         yes
``layers.*.attn.q_norm.weight``         ``...self_attention.q_norm.weight``              replicated  norm              yes
``layers.*.attn.wq_b.weight``           ``...self_attention.wq_b.weight``                column      attention         yes
``layers.*.attn.wkv.weight``            ``...self_attention.wkv.weight``                 replicated  attention         yes
``layers.*.attn.kv_norm.weight``        ``...self_attention.kv_norm.weight``             replicated  norm              yes
``layers.*.attn.wo_a.weight``           ``...self_attention.wo_a.weight``                column      attention         yes
``layers.*.attn.wo_b.weight``           ``...self_attention.wo_b.weight``                row         attention         yes
``layers.*.attn.compressor.{ape,wkv.weight,wgate.weight,norm.weight}``  ``...self_attention.compressor.{...}``  replicated  compressor
``layers.*.attn.indexer.wq_b.weight``   ``...self_attention.indexer.linear_wq_b.weight``  replicated  indexer
``layers.*.attn.indexer.weights_proj.weight``  ``...indexer.linear_weights_proj.weight``  replicated  indexer
``layers.*.attn.indexer.compressor.{...}``  ``...self_attention.indexer.compressor.{...}``  replicated  indexer
``layers.*.ffn.gate.weight``            ``...mlp.router.weight``                         replicated  routing           yes
``layers.*.ffn.gate.bias``              ``...mlp.router.expert_bias``                    replicated  routing           yes
``layers.*.ffn.gate.tid2eid``           ``...mlp.router.tid2eid`` (int64 buffer)         replicated  routing
``layers.*.ffn.experts.*.{w1,w3}.weight``  ``...mlp.experts.local_experts.*.linear_fc1.weight``  expert_gated_mlp  expert  yes
``layers.*.ffn.experts.*.w2.weight``    ``...mlp.experts.local_experts.*.linear_fc2.weight``  expert_row  expert     yes
``layers.*.ffn.shared_experts.{w1,w3}.weight``  ``...mlp.shared_experts.linear_fc1.weight``  replicated_gated_mlp  shared_expert  yes
``layers.*.ffn.shared_experts.w2.weight``  ``...mlp.shared_experts.linear_fc2.weight``  replicated  shared_expert     yes
``mtp.*.{enorm,hnorm}.weight``          ``mtp.layers.*.{enorm,hnorm}.weight``            replicated  mtp
``mtp.*.norm.weight``                   ``mtp.layers.*.final_layernorm.weight``          replicated  mtp
``mtp.*.{e_proj,h_proj}.weight``        ``mtp.layers.*.{e_proj,h_proj}.weight``          replicated  mtp
``mtp.*.hc_head_{fn,base,scale}``       ``mtp.layers.*.hc_head_params.hc_head_{...}``    replicated  mtp
======================================  ===============================================  ==========  ================  ===

Name resolution is a dict lookup on a normalized key (every all-digit segment -> ``*``), so it is
exactly-once by construction: the table refuses duplicate patterns, literal digit segments and
``*`` inside a segment, which are the only ways two rows could claim one name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from impl.errors import Dsv4Error

__all__ = [
    "GROUPS",
    "MAPPING_TABLE",
    "SEMANTICS",
    "MappingRow",
    "MappingTableError",
    "NativeMatch",
    "OfficialMatch",
    "check_mapping_table",
    "expected_official_names",
    "fill",
    "lookup_native",
    "lookup_official",
    "normalize",
    "scale_base",
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


class MappingTableError(Dsv4Error, ValueError):
    """The table itself is malformed (duplicate / ambiguous pattern, bad semantics or group)."""


@dataclass(frozen=True)
class MappingRow:
    """One tensor family: official pattern(s), native pattern, parallel semantics, group."""

    official: str | tuple[str, str]  # a (gate, up) pair for gated rows
    native: str
    semantics: str
    group: str
    note: str = ""

    @property
    def official_names(self) -> tuple[str, ...]:
        return self.official if isinstance(self.official, tuple) else (self.official,)

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


# (official suffix | (gate, up), native suffix, semantics, group, in MTP layer, note)
_LAYER_TEMPLATE: tuple[tuple[Any, str, str, str, bool, str], ...] = (
    ("attn_norm.weight", "input_layernorm.weight", "replicated", "norm", True, ""),
    ("ffn_norm.weight", "pre_mlp_layernorm.weight", "replicated", "norm", True, ""),
    *(
        (f"hc_{site}_{p}", f"hc_{site}_{p}", "replicated", "hyper_connection", True, "fp32")
        for site in ("attn", "ffn")
        for p in ("fn", "base", "scale")
    ),
    ("attn.attn_sink", "self_attention.attn_sink", "column", "attention_sink", True, "fp32, one per head"),
    ("attn.wq_a.weight", "self_attention.wq_a.weight", "replicated", "attention", True, ""),
    ("attn.q_norm.weight", "self_attention.q_norm.weight", "replicated", "norm", True, ""),
    ("attn.wq_b.weight", "self_attention.wq_b.weight", "column", "attention", True, "split by heads"),
    ("attn.wkv.weight", "self_attention.wkv.weight", "replicated", "attention", True, ""),
    ("attn.kv_norm.weight", "self_attention.kv_norm.weight", "replicated", "norm", True, ""),
    ("attn.wo_a.weight", "self_attention.wo_a.weight", "column", "attention", True, "split by output groups"),
    ("attn.wo_b.weight", "self_attention.wo_b.weight", "row", "attention", True, ""),
    *(
        (f"attn.compressor.{p}", f"self_attention.compressor.{p}", "replicated", "compressor", False, "ratio > 0")
        for p in ("ape", "wkv.weight", "wgate.weight", "norm.weight")
    ),
    (
        "attn.indexer.wq_b.weight",
        "self_attention.indexer.linear_wq_b.weight",
        "replicated",
        "indexer",
        False,
        "ratio 4",
    ),
    (
        "attn.indexer.weights_proj.weight",
        "self_attention.indexer.linear_weights_proj.weight",
        "replicated",
        "indexer",
        False,
        "ratio 4",
    ),
    *(
        (
            f"attn.indexer.compressor.{p}",
            f"self_attention.indexer.compressor.{p}",
            "replicated",
            "indexer",
            False,
            "ratio 4",
        )
        for p in ("ape", "wkv.weight", "wgate.weight", "norm.weight")
    ),
    ("ffn.gate.weight", "mlp.router.weight", "replicated", "routing", True, ""),
    ("ffn.gate.bias", "mlp.router.expert_bias", "replicated", "routing", True, "fp32, score-routed layers"),
    ("ffn.gate.tid2eid", "mlp.router.tid2eid", "replicated", "routing", False, "int64 buffer, hash layers"),
    (
        ("ffn.experts.*.w1.weight", "ffn.experts.*.w3.weight"),
        "mlp.experts.local_experts.*.linear_fc1.weight",
        "expert_gated_mlp",
        "expert",
        True,
        "global expert index in the official name, local in the native one",
    ),
    (
        "ffn.experts.*.w2.weight",
        "mlp.experts.local_experts.*.linear_fc2.weight",
        "expert_row",
        "expert",
        True,
        "global expert index in the official name, local in the native one",
    ),
    (
        ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
        "mlp.shared_experts.linear_fc1.weight",
        "replicated_gated_mlp",
        "shared_expert",
        True,
        "replicated over TP (impl.native.moe)",
    ),
    (
        "ffn.shared_experts.w2.weight",
        "mlp.shared_experts.linear_fc2.weight",
        "replicated",
        "shared_expert",
        True,
        "replicated over TP (impl.native.moe)",
    ),
)


def _prefixed(prefix: str, official: Any) -> str | tuple[str, str]:
    if isinstance(official, tuple):
        return (prefix + official[0], prefix + official[1])
    return prefix + official


def _build_table() -> tuple[MappingRow, ...]:
    rows: list[MappingRow] = [
        MappingRow("embed.weight", "embedding.word_embeddings.weight", "vocab", "embedding"),
        MappingRow("head.weight", "output_layer.weight", "vocab", "embedding"),
        MappingRow("norm.weight", "decoder.final_layernorm.weight", "replicated", "norm"),
        *(
            MappingRow(f"hc_head_{p}", f"decoder.hc_head_params.hc_head_{p}", "replicated", "hyper_connection", "fp32")
            for p in ("fn", "base", "scale")
        ),
    ]
    for off, nat, sem, grp, _in_mtp, note in _LAYER_TEMPLATE:
        rows.append(MappingRow(_prefixed("layers.*.", off), f"decoder.layers.*.{nat}", sem, grp, note))
    # MTP: generated from the same template, so a per-layer fix reaches the MTP layer too.
    for off, nat, sem, grp, in_mtp, note in _LAYER_TEMPLATE:
        if in_mtp:
            rows.append(
                MappingRow(
                    _prefixed("mtp.*.", off),
                    f"mtp.layers.*.mtp_model_layer.{nat}",
                    sem,
                    grp,
                    f"MTP copy of layers.*.{off if isinstance(off, str) else off[0]}" + (f"; {note}" if note else ""),
                )
            )
    rows += [
        MappingRow("mtp.*.enorm.weight", "mtp.layers.*.enorm.weight", "replicated", "mtp"),
        MappingRow("mtp.*.hnorm.weight", "mtp.layers.*.hnorm.weight", "replicated", "mtp"),
        MappingRow("mtp.*.norm.weight", "mtp.layers.*.final_layernorm.weight", "replicated", "mtp"),
        MappingRow("mtp.*.e_proj.weight", "mtp.layers.*.e_proj.weight", "replicated", "mtp"),
        MappingRow("mtp.*.h_proj.weight", "mtp.layers.*.h_proj.weight", "replicated", "mtp"),
        *(
            MappingRow(f"mtp.*.hc_head_{p}", f"mtp.layers.*.hc_head_params.hc_head_{p}", "replicated", "mtp", "fp32")
            for p in ("fn", "base", "scale")
        ),
    ]
    return tuple(rows)


MAPPING_TABLE: tuple[MappingRow, ...] = _build_table()

# --------------------------------------------------------------------------------------------------
# exactly-once resolution

_INDEX_SEGMENT = re.compile(r"\.([0-9]+)(?=\.)")  # an inner all-digit segment (the table has no other kind)


def normalize(name: str) -> tuple[str, tuple[str, ...]]:
    """``layers.3.ffn.experts.17.w1.weight`` -> (``layers.*.ffn.experts.*.w1.weight``, ("3", "17"))."""
    parts = _INDEX_SEGMENT.split(name)
    if len(parts) == 1:
        return name, ()
    return ".*".join(parts[0::2]), tuple(parts[1::2])


def _template(pattern: str) -> str:
    return pattern.replace("{", "{{").replace("}", "}}").replace("*", "{}")


def fill(pattern: str, captures: Iterable[str | int]) -> str:
    """Substitute the ``*`` segments of ``pattern`` in order."""
    caps = tuple(str(c) for c in captures)
    if len(caps) != pattern.count("*"):
        raise MappingTableError(f"{len(caps)} captures for {pattern.count('*')} wildcards in {pattern!r}")
    return _template(pattern).format(*caps)


def _check_pattern(pattern: str, row: MappingRow) -> None:
    for seg in pattern.split("."):
        if seg.isdigit():
            raise MappingTableError(f"literal index segment {seg!r} in {pattern!r} ({row}); use '*'")
        if "*" in seg and seg != "*":
            raise MappingTableError(f"'*' must be a whole segment in {pattern!r} ({row})")
    segs = pattern.split(".")
    if "*" in (segs[0], segs[-1]):
        raise MappingTableError(f"'*' must be an inner segment in {pattern!r} ({row})")


class _Entry(NamedTuple):
    row: MappingRow
    role: str | None
    target: tuple[str, ...]  # the other side's pattern(s) as str.format templates


def _build_index(table: Iterable[MappingRow]) -> tuple[dict[str, _Entry], dict[str, _Entry]]:
    official: dict[str, _Entry] = {}
    native: dict[str, _Entry] = {}
    for row in table:
        if row.semantics not in SEMANTICS:
            raise MappingTableError(f"unknown semantics {row.semantics!r} in {row}")
        if row.group not in GROUPS:
            raise MappingTableError(f"unknown group {row.group!r} in {row}")
        if row.is_gated != row.semantics.endswith("gated_mlp"):
            raise MappingTableError(f"gated semantics needs exactly a (gate, up) pair: {row}")
        _check_pattern(row.native, row)
        wildcards = row.native.count("*")
        if row.native in native:
            raise MappingTableError(f"duplicate native pattern {row.native!r}: {native[row.native].row} and {row}")
        native[row.native] = _Entry(row, None, tuple(_template(o) for o in row.official_names))
        roles: tuple[str | None, ...] = GATED_ROLES if row.is_gated else (None,)
        for role, name in zip(roles, row.official_names, strict=True):
            _check_pattern(name, row)
            if name.count("*") != wildcards:
                raise MappingTableError(f"wildcard count differs between {name!r} and {row.native!r}")
            if name in official:
                raise MappingTableError(f"duplicate official pattern {name!r}: {official[name].row} and {row}")
            official[name] = _Entry(row, role, (_template(row.native),))
    return official, native


def check_mapping_table(table: Iterable[MappingRow]) -> None:
    """Raise :class:`MappingTableError` unless every official and native name is claimed by at most one row of
    ``table`` (no duplicate pattern, no literal index segment, ``*`` only as a whole inner segment) and every row's
    semantics, group and wildcards agree. The module's own table passes this check at import."""
    _build_index(table)


_OFFICIAL_INDEX, _NATIVE_INDEX = _build_index(MAPPING_TABLE)


# Results are plain tuples, unpacked by callers (``official, row, native, role = hit``): a tuple comes from the
# interpreter's free list, a NamedTuple instance is a heap-type allocation and deallocation, a sizeable share of a
# routed-expert lookup (figures: docs/performance.md).
OfficialMatch = tuple[str, MappingRow, str, str | None]
"""``(official, row, native, role)``: an official name, its row, the (global-index) native name it loads into, and
``"gate"`` / ``"up"`` for gated rows (else None)."""
NativeMatch = tuple[str, MappingRow, tuple[str, ...]]
"""``(native, row, official)``: a (global-index) native name, its row and its official name(s) (gate, up if gated)."""


# The hot path. Each index is compiled into two regexes, routed-expert patterns (94% of a full-size manifest:
# 33k of Flash's 35k names) and the rest, so the common match runs a small automaton with few groups and the
# rare one pays one extra failed match.
# A regex is a character trie of its patterns, ``*`` as a ``([0-9]+)`` group (ASCII only: ``\d`` would also take
# other scripts' digits, and ``int()`` reads them, so ``layers.\u0663`` would alias layer 3), every pattern ending in
# an empty marker group, so one C-level ``fullmatch`` names the pattern (``lastindex`` = its marker) and holds the
# captures. Matching is linear in the name: every alternation branches on its next character. This is the same
# relation as "normalize, then look the key up" (``*`` is a whole inner segment and no literal segment is all
# digits, both checked by ``_check_pattern``), so a name fullmatches at most one pattern and the order of the
# tiers cannot change an answer; :func:`_check_compiled` proves it on every pattern at import.
# The lookup itself is generated source: the few routed-expert patterns are an inline ``if`` chain on the marker,
# the rest one small function each, indexed by marker. Each fetches its groups once and builds the other side's
# name(s) with f-strings, about half the cost of ``template % m.group(...)``.
_END = object()  # trie leaf key
_SAFE_PIECE = re.compile(r"[\w.]*")  # what may go verbatim into generated source


class _Tier(NamedTuple):
    fullmatch: Callable[[str], re.Match[str] | None]
    leaves: dict[int, tuple[_Entry, tuple[int, ...]]]  # marker group -> (entry, its capture groups)


def _compile_tier(index: Mapping[str, _Entry]) -> _Tier:
    trie: dict[Any, Any] = {}
    for pattern, entry in index.items():
        node = trie
        for i, literal in enumerate(pattern.split("*")):
            if i:
                node = node.setdefault("*", {})
            for ch in literal:
                node = node.setdefault(ch, {})
        node[_END] = entry
    leaves: dict[int, tuple[_Entry, tuple[int, ...]]] = {}
    n_groups = 0

    def emit(node: dict[Any, Any], captures: tuple[int, ...]) -> str:
        nonlocal n_groups
        chain = []
        while len(node) == 1 and _END not in node and "*" not in node:  # a literal run: no alternation
            ((ch, node),) = node.items()
            chain.append(re.escape(ch))
        branches = []
        for key, child in node.items():
            if key is _END:
                continue
            if key == "*":
                n_groups += 1
                branches.append(r"([0-9]+)" + emit(child, (*captures, n_groups)))
            else:
                branches.append(re.escape(key) + emit(child, captures))
        if _END in node:  # last: a longer pattern sharing this prefix is tried first
            n_groups += 1
            leaves[n_groups] = (node[_END], captures)
            branches.append("()")
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "".join(chain) + body

    return _Tier(re.compile(emit(trie, ())).fullmatch, leaves)


def _result_source(consts: dict[str, Any], entry: _Entry, captures: tuple[int, ...], many: bool) -> list[str]:
    """Statements that return one pattern's result from ``name`` and its match ``m``: ``c0 = m[3]; c1 = m[4];
    return (name, _k0, f"decoder.layers.{c0}.mlp...", 'gate')`` (the other side's names from ``entry.target``, a
    tuple of them if ``many``). The row is bound in ``consts``."""
    local = [f"c{i}" for i in range(len(captures))]
    exprs = []
    for target in entry.target:
        pieces = target.split("{}")
        if len(pieces) != len(captures) + 1 or not all(_SAFE_PIECE.fullmatch(p) for p in pieces):
            raise MappingTableError(f"cannot build names for {target!r} from groups {captures}")
        body = pieces[0] + "".join(f"{{{c}}}{piece}" for c, piece in zip(local, pieces[1:], strict=True))
        exprs.append("f" + repr(body))
    row = f"_k{len(consts)}"
    consts[row] = entry.row
    other = f"({', '.join(exprs)},)" if many else exprs[0]
    fields = f"name, {row}, {other}" + ("" if many else f", {entry.role!r}")
    return [*(f"{c} = m[{g}]" for c, g in zip(local, captures, strict=True)), f"return ({fields})"]


def _compile_lookup(
    name: str, index: Mapping[str, _Entry], many: bool, doc: str
) -> tuple[Callable[[str], Any], tuple[_Tier, _Tier]]:
    """The generated lookup for one direction, and its (routed-expert, everything else) tiers."""
    hot = _compile_tier({p: e for p, e in index.items() if e.row.is_expert})
    cold = _compile_tier({p: e for p, e in index.items() if not e.row.is_expert})
    consts: dict[str, Any] = {"_hot": hot.fullmatch, "_cold": cold.fullmatch}
    src = ["def lookup(name):", "    m = _hot(name)", "    if m is not None:", "        i = m.lastindex"]
    for j, (marker, (entry, captures)) in enumerate(hot.leaves.items()):
        src.append(f"        {'elif' if j else 'if'} i == {marker}:")
        src += ["            " + s for s in _result_source(consts, entry, captures, many)]
    src += ["    m = _cold(name)", "    if m is None:", "        return None", "    return _fins[m.lastindex](name, m)"]
    fins = [None] * (max(cold.leaves, default=0) + 1)
    for marker, (entry, captures) in cold.leaves.items():
        src.append(f"def _f{marker}(name, m):")
        src += ["    " + s for s in _result_source(consts, entry, captures, many)]
    namespace: dict[str, Any] = {"__builtins__": {}, "_fins": fins, **consts}
    exec("\n".join(src), namespace)  # built from checked identifier pieces, reprs of roles and generated names only
    for marker in cold.leaves:
        fins[marker] = namespace[f"_f{marker}"]
    lookup = namespace["lookup"]
    lookup.__name__ = lookup.__qualname__ = name
    lookup.__module__, lookup.__doc__ = __name__, doc
    lookup.__annotations__ = {"name": str, "return": f"{'NativeMatch' if many else 'OfficialMatch'} | None"}
    return lookup, (hot, cold)


lookup_official: Callable[[str], OfficialMatch | None]
lookup_native: Callable[[str], NativeMatch | None]
lookup_official, _OFFICIAL_TIERS = _compile_lookup(
    "lookup_official",
    _OFFICIAL_INDEX,
    many=False,
    doc="Resolve an official checkpoint name to ``(official, row, native, role)``; None if no row claims it.",
)
lookup_native, _NATIVE_TIERS = _compile_lookup(
    "lookup_native",
    _NATIVE_INDEX,
    many=True,
    doc="Resolve a native (global-index) parameter / buffer name to ``(native, row, official)``; None if no row "
    "claims it.",
)


def _check_compiled() -> None:
    """Every pattern, instantiated, resolves through the regexes exactly as through normalize + dict lookup, and
    matches in exactly one tier."""
    for index, lookup, tiers in (
        (_OFFICIAL_INDEX, lookup_official, _OFFICIAL_TIERS),
        (_NATIVE_INDEX, lookup_native, _NATIVE_TIERS),
    ):
        for pattern, entry in index.items():
            caps = [str(7 + 10 * i) for i in range(pattern.count("*"))]
            name = fill(pattern, caps)
            if sum(tier.fullmatch(name) is not None for tier in tiers) != 1:
                raise MappingTableError(f"{name!r} does not match exactly one tier of the compiled resolver")
            key, got_caps = normalize(name)
            hit = lookup(name)
            other = tuple(t.format(*got_caps) for t in entry.target)
            want = (name, entry.row, other[0], entry.role) if lookup is lookup_official else (name, entry.row, other)
            if key != pattern or hit != want or type(hit) is not tuple:
                raise MappingTableError(f"compiled resolver disagrees on {name!r}: {hit} != {want}")


_check_compiled()


def scale_base(name: str) -> str | None:
    """``X.scale`` -> ``X.weight`` (the block-scale companion's weight), else None."""
    return name[: -len(".scale")] + ".weight" if name.endswith(".scale") else None


# --------------------------------------------------------------------------------------------------
# the official manifest a configuration implies (what coverage calls "expected")


def _cfg(config: Any) -> Any:
    """Accept a native ``V4Config``, a transformers config or a ``config.json`` dict."""
    if hasattr(config, "compress_ratios") and hasattr(config, "num_hash_layers"):
        return config
    from impl.native.config import V4Config

    if isinstance(config, Mapping):
        from transformers import DeepseekV4Config

        config = DeepseekV4Config(**dict(config))
    return V4Config.from_hf(config)


def _layer_names(prefix: str, ratio: int, hash_layer: bool, n_experts: int, in_mtp: bool) -> Iterator[str]:
    for off, _nat, _sem, grp, mtp_ok, _note in _LAYER_TEMPLATE:
        if in_mtp and not mtp_ok:
            continue
        first = off if isinstance(off, str) else off[0]
        if grp == "compressor" and ratio == 0:
            continue
        if grp == "indexer" and ratio != 4:
            continue
        if first == "ffn.gate.tid2eid" and not hash_layer:
            continue
        if first == "ffn.gate.bias" and hash_layer:
            continue
        names = off if isinstance(off, tuple) else (off,)
        if grp == "expert":
            templates = [prefix + _template(n) for n in names]
            for e in range(n_experts):
                yield from (t.format(e) for t in templates)
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

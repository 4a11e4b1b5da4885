"""Name resolution over :data:`impl.conversion.mapping_table.MAPPING_TABLE`, in both native layouts.

One generated lookup per direction and layout: official <-> Miles (:func:`lookup_official`, :func:`lookup_native`)
and official <-> upstream Megatron-Core ``dsv4_hybrid`` (:func:`lookup_official_upstream`, :func:`lookup_upstream`);
:data:`NATIVE_LAYOUTS` names the pairs, and the table is re-exported here. Every name resolves to exactly one row by
construction; :func:`check_mapping_table` refuses what could break that, at import."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from impl.conversion.mapping_table import (
    GATED_ROLES,
    GROUPS,
    MAPPING_TABLE,
    SEMANTICS,
    MappingRow,
    MappingTableError,
)
from impl.errors import UnsupportedConfigError

__all__ = [
    "MAPPING_TABLE",
    "MappingRow",
    "NATIVE_LAYOUTS",
    "check_mapping_table",
    "lookup_native",
    "lookup_official",
    "lookup_official_upstream",
    "lookup_upstream",
]

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


# Upstream grouped experts number their weights inside the last segment (TEGroupedLinear ``weight0..weightE-1``);
# the only place a ``*`` may share a segment, and only in the upstream layout.
GROUPED_WEIGHT = "weight*"


def _check_pattern(pattern: str, row: MappingRow, *, grouped_ok: bool = False) -> None:
    segs = pattern.split(".")
    for i, seg in enumerate(segs):
        if seg.isdigit():
            raise MappingTableError(f"literal index segment {seg!r} in {pattern!r} ({row}); use '*'")
        if "*" in seg and seg != "*" and not (grouped_ok and seg == GROUPED_WEIGHT and i == len(segs) - 1):
            raise MappingTableError(f"'*' must be a whole segment in {pattern!r} ({row})")
    if "*" in (segs[0], segs[-1]):
        raise MappingTableError(f"'*' must be an inner segment in {pattern!r} ({row})")


class _Entry(NamedTuple):
    row: MappingRow
    role: str | None
    target: tuple[str, ...]  # the other side's pattern(s) as str.format templates


def _build_index(table: Iterable[MappingRow], layout: str = "miles") -> tuple[dict[str, _Entry], dict[str, _Entry]]:
    """(official pattern -> entry, native pattern -> entry) for one native layout ("miles" or "upstream")."""
    official: dict[str, _Entry] = {}
    native: dict[str, _Entry] = {}
    for row in table:
        if row.semantics not in SEMANTICS:
            raise MappingTableError(f"unknown semantics {row.semantics!r} in {row}")
        if row.group not in GROUPS:
            raise MappingTableError(f"unknown group {row.group!r} in {row}")
        if row.is_gated != row.semantics.endswith("gated_mlp"):
            raise MappingTableError(f"gated semantics needs exactly a (gate, up) pair: {row}")
        natives = row.layout_names(layout)
        if row.is_gated and len(natives) != 1:
            raise MappingTableError(f"a gated row cannot also split its native tensor: {row}")
        wildcards = natives[0].count("*")
        for pattern in natives:
            _check_pattern(pattern, row, grouped_ok=layout == "upstream")
            if pattern.count("*") != wildcards:
                raise MappingTableError(f"wildcard count differs between {pattern!r} and {natives[0]!r}")
            if pattern in native:
                raise MappingTableError(f"duplicate native pattern {pattern!r}: {native[pattern].row} and {row}")
            native[pattern] = _Entry(row, None, tuple(_template(o) for o in row.official_names))
        roles: tuple[str | None, ...] = GATED_ROLES if row.is_gated else (None,)
        for role, name in zip(roles, row.official_names, strict=True):
            _check_pattern(name, row)
            if name.count("*") != wildcards:
                raise MappingTableError(f"wildcard count differs between {name!r} and {natives[0]!r}")
            if name in official:
                raise MappingTableError(f"duplicate official pattern {name!r}: {official[name].row} and {row}")
            official[name] = _Entry(row, role, tuple(_template(n) for n in natives))
    return official, native


_OFFICIAL_INDEX, _NATIVE_INDEX = _build_index(MAPPING_TABLE)


def check_mapping_table(table: Iterable[MappingRow]) -> None:
    """Raise :class:`MappingTableError` unless every official and native name is claimed by at most one row of
    ``table`` (no duplicate pattern, no literal index segment, ``*`` only as a whole inner segment) and every row's
    semantics, group and wildcards agree. The module's own table passes this check at import.

    Name resolution is a lookup on a normalized key (every all-digit segment -> ``*``), so it is exactly-once by
    construction: duplicate patterns, literal digit segments and ``*`` inside a segment are the only ways two rows
    could claim one name. The one exception is the upstream grouped-expert weight (``linear_fc1.weight<E>``,
    :data:`GROUPED_WEIGHT`), checked pattern against pattern at import."""
    _build_index(table)
    _build_index(table, "upstream")


# Results are plain tuples, unpacked by callers (``official, row, native, role = hit``): a tuple comes from the
# interpreter's free list, a NamedTuple instance is a heap-type allocation on the routed-expert hot path
# (docs/performance.md).
OfficialMatch = tuple[str, MappingRow, str, str | None]
"""``(official, row, native, role)``: an official name, its row, the (global-index) native name it loads into, and
``"gate"`` / ``"up"`` for gated rows (else None)."""
NativeMatch = tuple[str, MappingRow, tuple[str, ...]]
"""``(native, row, official)``: a (global-index) native name, its row and its official name(s) (gate, up if gated)."""


# The hot path. Each index is compiled into two regexes, routed-expert patterns (most of a full-size manifest's
# names) and the rest, so the common match runs a small automaton with few groups and the
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


lookup_official_upstream: Callable[[str], OfficialMatch | None]
lookup_upstream: Callable[[str], NativeMatch | None]
_UP_OFFICIAL_INDEX, _UPSTREAM_INDEX = _build_index(MAPPING_TABLE, "upstream")
lookup_official_upstream, _UP_OFFICIAL_TIERS = _compile_lookup(
    "lookup_official_upstream",
    _UP_OFFICIAL_INDEX,
    many=False,
    doc="Resolve an official checkpoint name to ``(official, row, upstream, role)`` in the upstream Megatron-Core "
    "layout; a row split upstream (the three hyper-connection alphas) answers its first part, as Megatron-Bridge "
    "does (``row.upstream_names`` lists all). None if no row claims it.",
)
lookup_upstream, _UPSTREAM_TIERS = _compile_lookup(
    "lookup_upstream",
    _UPSTREAM_INDEX,
    many=True,
    doc="Resolve an upstream Megatron-Core (global-index) parameter name to ``(upstream, row, official)``; None if no "
    "row claims it.",
)


def _check_compiled(index: Mapping[str, _Entry], lookup: Callable[[str], Any], tiers: tuple[_Tier, ...]) -> None:
    """Every pattern, instantiated, resolves through the generated lookup to exactly its own entry, matches in
    exactly one tier, and no other pattern of the index claims it (for the Miles layout: normalize + dict lookup,
    the documented relation; the upstream layout's ``weight*`` is outside it, so every pattern is tried)."""
    many = lookup in (lookup_native, lookup_upstream)
    by_key = index is _NATIVE_INDEX or index is _OFFICIAL_INDEX
    rx = {} if by_key else {p: re.compile(re.escape(p).replace(r"\*", "([0-9]+)")) for p in index}
    for pattern, entry in index.items():
        caps = [str(7 + 10 * i) for i in range(pattern.count("*"))]
        name = fill(pattern, caps)
        if sum(tier.fullmatch(name) is not None for tier in tiers) != 1:
            raise MappingTableError(f"{name!r} does not match exactly one tier of the compiled resolver")
        claimed = [normalize(name)[0]] if by_key else [p for p, r in rx.items() if r.fullmatch(name)]
        hit = lookup(name)
        other = tuple(t.format(*caps) for t in entry.target)
        want = (name, entry.row, other) if many else (name, entry.row, other[0], entry.role)
        if claimed != [pattern] or hit != want or type(hit) is not tuple:
            raise MappingTableError(f"compiled resolver disagrees on {name!r}: {hit} != {want} (claimed by {claimed})")


for _args in (
    (_OFFICIAL_INDEX, lookup_official, _OFFICIAL_TIERS),
    (_NATIVE_INDEX, lookup_native, _NATIVE_TIERS),
    (_UP_OFFICIAL_INDEX, lookup_official_upstream, _UP_OFFICIAL_TIERS),
    (_UPSTREAM_INDEX, lookup_upstream, _UPSTREAM_TIERS),
):
    _check_compiled(*_args)
del _args


class NativeLayout(NamedTuple):
    """One native (Megatron) naming of the table: its two generated lookups."""

    name: str
    lookup_official: Callable[[str], OfficialMatch | None]  # official -> this layout
    lookup_native: Callable[[str], NativeMatch | None]  # this layout -> official
    description: str


#: The native layouts one table serves: the Miles graph this implementation builds (``impl.native``) and upstream
#: Megatron-Core's ``dsv4_hybrid`` graph, the names Megatron-Bridge's DeepSeekV4Bridge maps onto.
NATIVE_LAYOUTS: dict[str, NativeLayout] = {
    "miles": NativeLayout(
        "miles", lookup_official, lookup_native, "Miles native graph (impl.native): self_attention.wq_a, ..."
    ),
    "upstream": NativeLayout(
        "upstream",
        lookup_official_upstream,
        lookup_upstream,
        "upstream Megatron-Core dsv4_hybrid (Megatron-Bridge DeepSeekV4Bridge): self_attention.linear_q_down_proj, ...",
    ),
}


def native_layout(name: str) -> NativeLayout:
    """The layout called ``name``; :class:`UnsupportedConfigError` naming the choices otherwise."""
    try:
        return NATIVE_LAYOUTS[name]
    except (KeyError, TypeError):
        raise UnsupportedConfigError(
            f"unknown native layout {name!r}; choose one of {sorted(NATIVE_LAYOUTS)}"
        ) from None


def scale_base(name: str) -> str | None:
    """``X.scale`` -> ``X.weight`` (the block-scale companion's weight), else None."""
    return name[: -len(".scale")] + ".weight" if name.endswith(".scale") else None

"""The on-disk layouts a DeepSeek-V4 base comes in, and the official name of every tensor of each.

``official`` is the released checkpoint's naming, the one the mapping table maps; the two transformers layouts are
what ``save_pretrained`` writes (:class:`BaseLayout`). A ``transformers`` name is read back through
:func:`impl.adapter.kinds.place_module`, the one table of what every module of a V4 base is, plus the parameter
leaves below, so no second name table exists."""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum

from impl.adapter.kinds import place_module  # up a floor: the one table of every V4 module's place


class BaseLayout(StrEnum):
    """A base's on-disk naming.

    ``official`` is the released checkpoint's naming (``embed.weight``, ``layers.N.attn.wq_a.weight``,
    ``mtp.K...``), the one :data:`impl.conversion.mapping_table` maps. ``transformers`` is what transformers'
    ``save_pretrained`` writes for a ``DeepseekV4ForCausalLM`` (every merged or re-saved model): its module names
    (``model.layers.N.self_attn.q_a_proj.weight``, ``model.layers.N.attn_hc.fn``), but ``head.weight`` and
    per-expert ``model.layers.N.mlp.experts.E.w1.weight`` as the checkpoint had them, and no MTP (transformers'
    model has none). ``transformers-checkpoint`` is what newer transformers (5.23, 5.24) writes instead: the
    checkpoint's own names under ``model.`` (``model.layers.N.attn.wq_a.weight``), but ``model.embed_tokens.weight``,
    ``model.norm.weight``, ``model.hc_head.hc_fn`` and ``model.layers.N.attn.norm.weight`` for the KV norm;
    ``head.weight``; no MTP.
    """

    OFFICIAL = "official"
    TRANSFORMERS = "transformers"
    TRANSFORMERS_CHECKPOINT = "transformers-checkpoint"


#: layouts transformers' save_pretrained writes (its model has no MTP: the absence is the layout, not a hole)
SAVED_BY_TRANSFORMERS = frozenset({BaseLayout.TRANSFORMERS, BaseLayout.TRANSFORMERS_CHECKPOINT})


#: what each layout is, for messages
DESCRIPTION = {
    BaseLayout.OFFICIAL: "the official checkpoint naming (embed.weight, layers.N.attn.wq_a.weight, mtp.K...)",
    BaseLayout.TRANSFORMERS: "transformers' save_pretrained naming (model.embed_tokens.weight, "
    "model.layers.N.self_attn.q_a_proj.weight; no MTP)",
    BaseLayout.TRANSFORMERS_CHECKPOINT: "newer transformers' save_pretrained naming (model.embed_tokens.weight, "
    "model.layers.N.attn.wq_a.weight; no MTP)",
}
#: a name only this layout writes (the embedding: every V4 base has one); both transformers layouts write
#: model.embed_tokens.weight, told apart by the main attention's module path (_CHECKPOINT_ATTENTION)
_MARKER = {BaseLayout.OFFICIAL: "embed.weight", BaseLayout.TRANSFORMERS: "model.embed_tokens.weight"}
_CHECKPOINT_ATTENTION = re.compile(r"model\.layers\.\d+\.attn\.wq_a\.weight")
#: transformers-checkpoint: the names (after model.) that differ from the checkpoint's: template -> official
_CHECKPOINT_RENAMED = (
    (re.compile(r"embed_tokens\.weight"), "embed.weight"),
    (re.compile(r"hc_head\.hc_(base|fn|scale)"), r"hc_head_\1"),
    (re.compile(r"layers\.(\d+)\.attn\.norm\.weight"), r"layers.\1.attn.kv_norm.weight"),
)
#: names save_pretrained writes as the checkpoint had them (its reverse renaming keeps them): template -> official
_KEPT = (
    (re.compile(r"head\.weight"), r"head.weight"),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight"), r"layers.\1.ffn.experts.\2.\3.weight"),
)
#: transformers parameter leaf -> official leaf, where they differ (the router's correction bias)
_LEAVES = {"e_score_correction_bias": "bias"}
#: parameter leaves a module name is followed by in both layouts
_PLAIN_LEAVES = ("weight", "bias", "tid2eid")


def detect_layout(names: Iterable[str]) -> BaseLayout | None:
    """The layout whose embedding name is present (None: neither, a base of no known layout)."""
    present = set(names)
    found = [layout for layout, marker in _MARKER.items() if marker in present]
    if found == [BaseLayout.TRANSFORMERS] and any(_CHECKPOINT_ATTENTION.fullmatch(n) for n in present):
        return BaseLayout.TRANSFORMERS_CHECKPOINT
    return found[0] if len(found) == 1 else None


def official_name(name: str, layout: BaseLayout) -> str | None:
    """The official name of tensor ``name`` stored in ``layout``; None when it names nothing of a V4 base."""
    if layout is BaseLayout.OFFICIAL:
        return name
    if layout is BaseLayout.TRANSFORMERS_CHECKPOINT:
        return _checkpoint_under_model(name)
    for pattern, official in _KEPT:
        if pattern.fullmatch(name):
            return pattern.sub(official, name)
    module, _, leaf = name.rpartition(".")
    if leaf in _PLAIN_LEAVES or leaf in _LEAVES:
        place = _transformers_place(module)
        return None if place is None else f"{place}.{_LEAVES.get(leaf, leaf)}"
    return _transformers_place(name)  # a parameter that is a module of its own (attn_hc.fn, sinks, position_bias)


def _checkpoint_under_model(name: str) -> str | None:
    if name == "head.weight":
        return name
    if not name.startswith("model."):
        return None
    inner = name.removeprefix("model.")
    official = next((p.sub(o, inner) for p, o in _CHECKPOINT_RENAMED if p.fullmatch(inner)), inner)
    place = place_module(official)
    return official if place is not None and place.dialect == "official" and not official.startswith("mtp.") else None


def _transformers_place(path: str) -> str | None:
    place = place_module(path) if path else None
    if place is None or place.official is None or place.dialect != "transformers":
        return None
    return place.official


def read_as_official(names: Iterable[str]) -> tuple[BaseLayout, dict[str, str], list[str]]:
    """(the layout found, official name -> stored name, stored names of no V4 tensor) for a base's tensor names;
    names of no known layout are taken as official (what the official checks then judge)."""
    names = list(names)
    layout = detect_layout(names) or BaseLayout.OFFICIAL
    if layout is BaseLayout.OFFICIAL:
        return layout, {n: n for n in names}, []
    return (layout, *translate(names, layout))


def translate(names: Iterable[str], layout: BaseLayout) -> tuple[dict[str, str], list[str]]:
    """(official name -> stored name, stored names that translate to nothing)."""
    out: dict[str, str] = {}
    unknown = []
    for name in names:
        official = official_name(name, layout)
        if official is None:
            unknown.append(name)
        else:
            out[official] = name
    return out, unknown


__all__ = [
    "DESCRIPTION",
    "SAVED_BY_TRANSFORMERS",
    "BaseLayout",
    "detect_layout",
    "official_name",
    "read_as_official",
    "translate",
]

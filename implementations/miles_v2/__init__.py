"""Miles' DeepSeek-V4 LoRA at a later revision (context-labs/miles commit a462f0b) under the conformance suites.

Only two capabilities can honestly run: no checkout of a462f0b exists, only three of its files do, and its native
graph (the "post-#2706" graph: ``linear_q_down_proj``, ``core_attention.indexer.linear_wq_b``, ...) cannot be built
on a CPU host, while the reference graph carries the older names and cannot stand in for it.

What of Miles is driven, unchanged, from the tree ``MILES_V2_DIR`` names (put on ``sys.path``; no Miles code is in
this repository):

* detection: ``miles_plugins.megatron_bridge.deepseek_v4.is_deepseek_v4_config`` (a462f0b's own file);
* targets: ``bridge_lora_helpers._qualify_deepseek_v4_lora_targets`` (a462f0b's own file), then
  ``lora_utils.create_lora_instance`` (Miles' HF-to-Megatron target conversion and Megatron-Bridge's ``LoRA``; this
  file is a stand-in copied from 7fb0c40a, a462f0b's is not available), and Megatron-Bridge's own matcher
  (``LoRA.match``, which decides what ``LoRA`` wraps) over the module names of the post-#2706 graph.

Those module names are built here from a462f0b's plugin mapping table (``_get_dsv4_explicit_mappings``: every
``<module>.weight`` of a decoder layer; a bare parameter such as ``linear_o_group_proj`` is no module), with a
compressor on each compressed layer and an indexer on each ratio-4 layer as the post-#2706 graph builds them
(which layers those are: the config's layer types, read by ``impl.V4Config``). A selected module is named in the
checkpoint's vocabulary through the same table (``model.layers.N.self_attn.X`` is ``layers.N.attn.X``).

Known gaps: ``xfails.txt`` beside this file; the report: docs/conformance/miles_v2.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from dsv4_conformance.driver import Driver, LoraSpec
from implementations.miles_v1 import bridge_selection, hf_config, load_miles, miles_args, miles_lora
from implementations.miles_v1 import unavailable as _unavailable

ENV = "MILES_V2_DIR"
REPOSITORY = "context-labs/miles"
COMMIT = "a462f0b896dfd9b2758a570cd306ab1fd2b63110"
#: the tree's files that are a462f0b's own; the rest (lora_utils.py, hf_export.py, model_provider.py among them) are
#: stand-ins: radixark/miles PR #2706's head with 7fb0c40a's versions of those three files
REAL_FILES = (
    "miles/backends/megatron_utils/bridge_lora_helpers.py",
    "miles_plugins/megatron_bridge/deepseek_v4.py",
    "tests/fast/plugins/test_deepseek_v4_bridge.py",
)

#: absent modules the driven path imports, as import-only placeholders: none (detection and targets import no Ray,
#: SGLang or datasets)
STAND_INS: dict[str, str] = {}

_LAYER = re.compile(r"^decoder\.layers\.\*\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")


def _load() -> Any:
    return load_miles(ENV, STAND_INS)


def _layer_table() -> dict[str, str]:
    """a462f0b's mapping table, per decoder layer: Megatron module (below ``decoder.layers.N.``) -> HF weight."""
    from miles_plugins.megatron_bridge.deepseek_v4 import _get_dsv4_explicit_mappings

    table = {}
    for mapping in _get_dsv4_explicit_mappings():
        megatron, hf = mapping.megatron_param, mapping.hf_param
        if _LAYER.match(megatron) and megatron.endswith(".weight") and isinstance(hf, str):
            table[_LAYER.sub("", megatron).removesuffix(".weight")] = hf
    return table


def _present(module: str, ratio: int) -> bool:
    """Whether the post-#2706 graph builds ``module`` on a layer of this compress ratio."""
    if ".core_attention.indexer." in f".{module}.":
        return ratio == 4
    if ".core_attention.compressor." in f".{module}.":
        return ratio > 0
    return True


def post_2706_modules(config: Mapping[str, Any], table: Mapping[str, str]) -> list[tuple[None, str, str]]:
    """``(None, prefix, name)`` of every module of the decoder layers (and their parents), as Megatron-Bridge's
    walk names them; no module object exists (the matcher reads names only when targets are given)."""
    api = _load()
    ratios = api.V4Config.from_hf(hf_config(config)).compress_ratios
    paths: dict[str, None] = {"decoder": None, "decoder.layers": None}
    for layer, ratio in enumerate(ratios):
        for module in table:
            if _present(module, ratio):
                parts = f"decoder.layers.{layer}.{module}".split(".")
                paths.update({".".join(parts[:end]): None for end in range(3, len(parts) + 1)})
    return [(None, *path.rpartition(".")[::2]) for path in paths]


def checkpoint_name(module: str, table: Mapping[str, str]) -> str:
    """A selected Megatron module in the checkpoint's vocabulary, through a462f0b's table (unchanged if no row)."""
    found = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", module)
    hf = table.get(found.group(2)) if found else None
    if hf is None:
        return module
    hf = hf.replace("model.layers.*.", f"model.layers.{found.group(1)}.").removesuffix(".weight")
    return _HF_LAYER.sub(r"layers.\1.attn.", hf)


class MilesV2Driver(Driver):
    name = "Miles a462f0b (partial)"
    capabilities = frozenset({"detection", "targets"})
    success_marker = None  # a462f0b's hf_export.py is not available; no export is declared

    def warm(self) -> None:
        _load()
        import miles.backends.megatron_utils.bridge_lora_helpers  # noqa: F401
        import miles_plugins.megatron_bridge.deepseek_v4  # noqa: F401

    def recognises(self, config: Mapping[str, Any]) -> bool:
        _load()
        import types

        from miles_plugins.megatron_bridge.deepseek_v4 import is_deepseek_v4_config

        # the parsed config.json as attributes, as Miles' own tests pass it; load_hf_config gives the same field
        return is_deepseek_v4_config(types.SimpleNamespace(**config))

    def qualify(self, targets: Sequence[str], config: Mapping[str, Any]) -> list[str]:
        _load()
        table = _layer_table()
        lora = miles_lora(miles_args("", LoraSpec(targets=tuple(targets), rank=2, alpha=2.0)))
        return [checkpoint_name(m, table) for m in bridge_selection(lora, post_2706_modules(config, table))]


def unavailable() -> str:
    """'' when ``MILES_V2_DIR`` names a directory, else why this driver cannot run here."""
    return _unavailable(ENV, f"{REPOSITORY} {COMMIT[:7]} (or its reconstruction: PR #2706's tree plus its own files)")


DRIVER = MilesV2Driver(
    provenance=(
        f"{REPOSITORY} commit {COMMIT}, imported from ${ENV}; that commit's own files: {', '.join(REAL_FILES)}; "
        "every other file is a stand-in (radixark/miles PR #2706's head, with lora_utils.py, hf_export.py and "
        "model_provider.py from radixark/miles 7fb0c40a), so create_lora_instance's target conversion is 7fb0c40a's; "
        "the post-#2706 graph's module names come from a462f0b's plugin mapping table, its compressed and indexer "
        "layers from the config's layer types; no import-only stand-ins are needed"
    )
)

"""Miles' DeepSeek-V4 LoRA (radixark/miles commit 7fb0c40a, PR #2772) under the conformance suites.

What of Miles is driven, unchanged, from the checkout that ``MILES_V1_DIR`` names (put on ``sys.path`` here; no
Miles code is in this repository):

* detection: ``miles_plugins.megatron_bridge.deepseek_v4.is_deepseek_v4_config``;
* targets and LoRA construction: ``bridge_lora_helpers._qualify_deepseek_v4_lora_targets`` and
  ``lora_utils.create_lora_instance`` (Miles' target conversion, then Megatron-Bridge's ``LoRA``), applied as
  ``_setup_deepseek_v4_lora_model``'s pre-wrap hook applies it (``lora(chunks, training=True)``, then
  ``set_params_to_save``); ``qualify`` reports what Bridge's own matcher selects with that ``LoRA``;
* export: ``hf_export.save_hf_model(args, rollout_id, model, path=out_dir, raise_on_error=True)``, which calls
  ``lora_utils.save_lora_checkpoint`` and writes ``.complete``; import: ``lora_utils.load_lora_adapter``;
* Miles' parallel state: ``create_megatron_parallel_state`` with ``create_indep_dp_group``'s trivial group.

What stands in for Miles, and why: Miles' native V4 model needs TransformerEngine and tile_kernels, so the graph is
the reference implementation's native graph (``impl.build_native_model``; its modules carry exactly Miles v1's
names, ``decoder.layers.N.self_attention.wq_b``, ``...indexer.linear_wq_b``), loaded by ``impl.load_official_checkpoint``,
run by ``impl.ManualPipeline`` and trained by ``impl.adapter_train_step`` (Miles' trainer is a Ray actor). Two
things make that graph present what Miles' graph presents: Miles' ``LoRA`` is re-typed as ``impl.DeepseekV4LoRA``
(the same dataclass fields; it gives the stand-in's plain ``ReplicatedLinear`` the adapter Bridge gives Miles'
duplicated ``TELinear``), and each chunk gets GPTModel's ``share_embeddings_and_output_weights``. Modules Miles
imports that are absent here and unused on this path are import-only placeholders (:data:`STAND_INS`).
``_setup_deepseek_v4_lora_model`` itself is not called: it builds Miles' native provider and imports
``megatron.bridge.training.config``, which needs ``datasets``.

Known gaps: ``xfails.txt`` beside this file; the report: docs/conformance/miles_v1.md.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_conformance.driver import Driver, Layout, LoraSpec

ENV = "MILES_V1_DIR"
REPOSITORY = "radixark/miles"
COMMIT = "7fb0c40a27c97027ce327e240c0c86ef296ab949"

#: absent modules Miles imports on the driven path, each an import-only placeholder (any use raises); installed only
#: where the real module cannot be imported
STAND_INS: dict[str, str] = {
    "ray": "imported at module level by miles.utils.misc and by hf_export's import chain "
    "(update_weight.common: ray, ray.actor) for rollout actors; the driven path runs in-process and calls no Ray API",
    "sglang": "imported by hf_export's import chain (megatron_utils.sglang, update_weight.hf_weight_iterator_direct: "
    "sglang.srt.*) for rollout weight sync; the adapter-only V4 export never reaches SGLang",
}

#: where the released Megatron-Bridge differs from the fork Miles pins (radixark/Megatron-Bridge 7f0fb345, Miles'
#: Dockerfile), each adapted by the driver, so what is judged is Miles' own code and not the version mismatch
BRIDGE_FORK: dict[str, str] = {
    "AutoBridge.export_adapter_weights": "the fork yields (name, tensor, base name) triples, which "
    "save_lora_checkpoint unpacks; 0.6.2 yields (name, tensor) pairs, given here as triples with no base name "
    "(Miles does not read it on this path)",
}

#: the Miles modules the driven path imports, warmed before a rank's clock starts
MILES_MODULES = (
    "miles_plugins.megatron_bridge.deepseek_v4",
    "miles.backends.megatron_utils.bridge_lora_helpers",
    "miles.backends.megatron_utils.lora_utils",
    "miles.backends.megatron_utils.hf_export",
    "miles.backends.megatron_utils.parallel",
)


def unavailable(env: str = ENV, what: str = f"{REPOSITORY} {COMMIT[:8]}") -> str:
    """'' when ``env`` names an existing directory, else why this driver cannot run here (one line)."""
    where = os.environ.get(env, "")
    if not where:
        return f"{env} is not set: point it at a checkout of {what} (its miles/ and miles_plugins/)"
    if not Path(where).is_dir():
        return f"{env}={where} is not a directory: point it at a checkout of {what}"
    return ""


# ------------------------------------------------------------------------------------------ Miles on sys.path


class _Placeholder(types.ModuleType):
    """An absent module, for import only: each attribute is a class that refuses to be instantiated or called."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        module = self.__name__

        def refuse(*_args: Any, **_kwargs: Any) -> None:
            raise RuntimeError(f"{module}.{name} is an import-only stand-in of the conformance driver (STAND_INS)")

        value = type(name, (), {"__init__": refuse, "__call__": refuse})
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _install_stand_ins(stand_ins: Mapping[str, str]) -> None:
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return
    absent = frozenset(name for name in stand_ins if importlib.util.find_spec(name) is None)
    if absent:
        sys.meta_path.insert(0, _StandInFinder(absent))


def load_miles(env: str = ENV, stand_ins: Mapping[str, str] = STAND_INS) -> Any:
    """This repo's CPU stand-ins first (megatron-core must see that TransformerEngine is absent before
    megatron.bridge imports), then the placeholders, then Miles' checkout at the end of ``sys.path`` (this
    repository's packages keep their names); returns ``impl``."""
    why = unavailable(env)
    if why:
        raise RuntimeError(why)
    api = importlib.import_module("impl")
    api.compat_report()
    _install_stand_ins(stand_ins)
    where = str(Path(os.environ[env]).resolve())
    if where not in sys.path:
        sys.path.append(where)
    return api


# ------------------------------------------------------------------------------------------ Miles' inputs


def hf_config(config: Mapping[str, Any] | Path) -> Any:
    """transformers' own ``DeepseekV4Config`` (never AutoConfig: Miles' ``load_hf_config`` re-registers the
    ``deepseek_v4`` model type as a DeepseekV3Config subclass, process-wide)."""
    from transformers import DeepseekV4Config

    if isinstance(config, Path):
        config = json.loads((config / "config.json").read_text())
    return DeepseekV4Config.from_dict(dict(config))


def miles_args(base: str, lora: LoraSpec | None, *, bf16: bool = False) -> Namespace:
    """The fields of Miles' argparse namespace the driven functions read (arguments.py names)."""
    spec = lora or LoraSpec(targets=(), rank=0)
    return Namespace(
        hf_checkpoint=base,
        target_modules=list(spec.targets),
        exclude_modules=None,
        lora_rank=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=0.0,
        lora_type="lora",
        multi_lora=False,
        bf16=bf16,
        fp16=False,
        save_hf=None,
        megatron_to_hf_mode="bridge",
        model_name=None,
    )


def miles_lora(args: Namespace) -> Any:
    """Miles' ``LoRA`` for ``args``, as ``_setup_deepseek_v4_lora_model`` builds it: targets and exclusions
    qualified, then ``create_lora_instance`` on a copy of the arguments."""
    from miles.backends.megatron_utils.bridge_lora_helpers import _qualify_deepseek_v4_lora_targets
    from miles.backends.megatron_utils.lora_utils import create_lora_instance

    lora_args = copy.copy(args)
    lora_args.target_modules = _qualify_deepseek_v4_lora_targets(args.target_modules)
    lora_args.exclude_modules = _qualify_deepseek_v4_lora_targets(getattr(args, "exclude_modules", None))
    return create_lora_instance(lora_args)


def bridge_selection(lora: Any, modules: Sequence[tuple[Any, str, str]]) -> list[str]:
    """The full names Megatron-Bridge's matcher (``lora.match``, which decides what ``LoRA`` wraps) selects among
    ``(module, prefix, name)``; with targets given it reads the names only."""
    selected = []
    for module, prefix, name in modules:
        hit = lora.match(module, name, prefix)
        if hit is not None:
            selected.append(hit[1])
    return selected


def walk_names(model: Any) -> list[tuple[Any, str, str]]:
    """``(module, prefix, name)`` of every module as Megatron-Bridge's PEFT walk names it (``walk_utils.walk``)."""
    from megatron.bridge.peft.walk_utils import walk

    seen: list[tuple[Any, str, str]] = []

    def visit(module: Any, name: str | None = None, prefix: str | None = None) -> Any:
        if name:
            seen.append((module, prefix or "", name))
        return module

    walk(model, visit)
    return seen


# ------------------------------------------------------------------------------------------ the model


@dataclass
class MilesModel:
    chunks: list[Any]
    args: Namespace
    base: Path


def _on_stand_in_graph(api: Any, lora: Any) -> Any:
    """Miles' ``LoRA``, re-typed for the stand-in graph: ``impl.DeepseekV4LoRA`` has ``LoRA``'s fields and
    transform, plus the adapter Bridge gives Miles' duplicated ``TELinear`` for the stand-in's ``ReplicatedLinear``
    (Bridge's own ``LoRA`` raises on a module type Miles' graph does not have)."""
    from megatron.bridge.peft.lora import LoRA

    if type(lora) is not LoRA:
        raise TypeError(f"Miles built a {type(lora).__name__}; the stand-in graph takes Megatron-Bridge's LoRA only")
    fields = {f.name: getattr(lora, f.name) for f in dataclasses.fields(lora) if f.init}
    return api.DeepseekV4LoRA(**fields)


def miles_pre_wrap_hook(api: Any, args: Namespace) -> Callable[[list[Any]], list[Any]]:
    """``_setup_deepseek_v4_lora_model``'s pre-wrap hook (PEFT before DDP), with Miles' ``LoRA``."""
    lora = _on_stand_in_graph(api, miles_lora(args))

    def apply_lora_hook(model_chunks: list[Any]) -> list[Any]:
        transformed = lora(model_chunks, training=True)
        lora.set_params_to_save(transformed)
        return transformed

    return apply_lora_hook


def _set_miles_parallel_state(args: Namespace) -> None:
    """Miles' ``ParallelState`` from megatron's groups, as ``initialize.init`` sets it (no independent DP)."""
    import torch.distributed as dist
    from megatron.training.global_vars import set_args
    from miles.backends.megatron_utils.ft.indep_dp import create_indep_dp_group
    from miles.backends.megatron_utils.parallel import create_megatron_parallel_state
    from miles.backends.training_utils.parallel import set_parallel_state
    from miles.utils.ft_utils.indep_dp import IndepDPInfo

    set_args(args)
    indep_dp = create_indep_dp_group(
        store_addr=None,
        indep_dp_info=IndepDPInfo.create_trivial(),
        megatron_rank=dist.get_rank(),
        megatron_world_size=dist.get_world_size(),
    )
    set_parallel_state(create_megatron_parallel_state(indep_dp=indep_dp))


def _as_gpt_model(chunks: list[Any], config: Any) -> None:
    """Give each stand-in chunk the GPTModel attribute Miles' export reads (``patch_megatron_model``)."""
    from megatron.core.utils import unwrap_model

    for model in unwrap_model(chunks):
        model.share_embeddings_and_output_weights = bool(getattr(config, "tie_word_embeddings", False))


def _as_bridge_fork() -> None:
    """:data:`BRIDGE_FORK`: the released ``export_adapter_weights`` yielding the fork's triples."""
    from megatron.bridge import AutoBridge

    released = AutoBridge.export_adapter_weights
    if getattr(released, "as_bridge_fork", False):
        return

    def export_adapter_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        for name, tensor in released(self, *args, **kwargs):
            yield name, tensor, None

    export_adapter_weights.as_bridge_fork = True  # type: ignore[attr-defined]
    AutoBridge.export_adapter_weights = export_adapter_weights


# ------------------------------------------------------------------------------------------ the driver


class MilesV1Driver(Driver):
    name = "Miles 7fb0c40a (PR #2772)"
    capabilities = frozenset({"detection", "targets", "lora", "export", "faults", "training_loop"})
    success_marker = ".complete"

    def warm(self) -> None:
        load_miles()
        for module in MILES_MODULES:
            importlib.import_module(module)

    def recognises(self, config: Mapping[str, Any]) -> bool:
        load_miles()
        from miles_plugins.megatron_bridge.deepseek_v4 import is_deepseek_v4_config

        # the parsed config.json as attributes, as Miles' own tests pass it; load_hf_config gives the same field
        return is_deepseek_v4_config(types.SimpleNamespace(**config))

    def qualify(self, targets: Sequence[str], config: Mapping[str, Any]) -> list[str]:
        import torch

        from impl.driver import _init_parallel, _official

        api = load_miles()
        _init_parallel(api, Layout())
        lora = miles_lora(miles_args("", LoraSpec(targets=tuple(targets), rank=2, alpha=2.0)))
        with torch.device("meta"):  # the whole stand-in graph, no memory: full-size configs too
            model = api.DeepseekV4NativeModel(api.V4Config.from_hf(hf_config(config)))
        return [_official(api, name) for name in bridge_selection(lora, walk_names(model))]

    def build(self, base: Path, layout: Layout, lora: LoraSpec | None) -> MilesModel:
        from impl.driver import _init_parallel, build_graph

        api = load_miles()
        _init_parallel(api, layout)
        args = miles_args(str(base), lora, bf16=layout.dtype == "bfloat16")
        _set_miles_parallel_state(args)  # before the hook: Miles' LoRA reads it
        hook = miles_pre_wrap_hook(api, args) if lora is not None else None
        chunks, _ = build_graph(api, base, layout, hook, initialise=False)  # its load report is the reference's
        _as_gpt_model(chunks, hf_config(base))
        return MilesModel(chunks, args, base)

    def logits(self, model: MilesModel, input_ids: Any) -> Any:
        from impl.driver import ReferenceDriver

        return ReferenceDriver().logits(model, input_ids)

    def train_step(self, model: MilesModel, input_ids: Any, labels: Any, lr: float) -> float:
        from impl.driver import ReferenceDriver

        return ReferenceDriver().train_step(model, input_ids, labels, lr)

    def adapter_parameters(self, model: MilesModel) -> dict[str, Any]:
        from impl.driver import ReferenceDriver

        return ReferenceDriver().adapter_parameters(model)

    def export(self, model: MilesModel, out_dir: Path, timeout_s: float) -> None:
        # Miles' export takes no timeout: its barriers wait as long as the default process group allows
        load_miles()
        _as_bridge_fork()
        from miles.backends.megatron_utils.hf_export import save_hf_model

        save_hf_model(model.args, 0, model.chunks, path=out_dir, raise_on_error=True)

    def import_adapter(self, model: MilesModel, adapter_dir: Path) -> None:
        # save_hf_model wrote the adapter to <path>/adapter; Miles resumes from that directory (a miss is a warning)
        load_miles()
        from miles.backends.megatron_utils.lora_utils import load_lora_adapter

        load_lora_adapter(model.chunks, str(Path(adapter_dir) / "adapter"))


DRIVER = MilesV1Driver(
    provenance=(
        f"{REPOSITORY} commit {COMMIT} (PR #2772), imported from ${ENV}: is_deepseek_v4_config, "
        "_qualify_deepseek_v4_lora_targets, create_lora_instance and the pre-wrap hook of "
        "_setup_deepseek_v4_lora_model, save_hf_model / save_lora_checkpoint, load_lora_adapter; the model graph, "
        "base loading, forward and training step are the reference implementation's (impl), Miles' native graph "
        "needing TransformerEngine and tile_kernels; import-only stand-ins for absent modules: "
        + ", ".join(sorted(STAND_INS))
        + "; adapted to the Megatron-Bridge fork Miles pins: "
        + ", ".join(sorted(BRIDGE_FORK))
    )
)

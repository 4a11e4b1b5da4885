"""Pipeline layouts for DeepSeek-V4 (the Megatron-Bridge #4306 behaviour, ``docs/reference/megatron_bridge.md``).

A layout is one list of Megatron-Core layer tokens per (virtual) pipeline stage; the rules a layout must keep are in
:func:`validate_pipeline_layout`. The same resolved layout must drive load and export. A saved run configuration that
lost the layout is regenerated, never guessed (:func:`resolve_pipeline_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from impl.errors import PipelineLayoutError

__all__ = [
    "generate_pipeline_layout",
    "resolve_pipeline_layout",
    "run_pipeline_layout",
    "saved_pipeline_layout",
    "stage_layer_numbers",
    "validate_pipeline_layout",
]

Layout = tuple[tuple[str, ...], ...]
TOKENS = ("embedding", "decoder", "mtp", "loss")
#: What a saved Megatron-Bridge run writes next to its checkpoint (in the run directory or in each ``iter_*``).
RUN_CONFIG = "run_config.yaml"


def generate_pipeline_layout(num_layers: int, stages: int, *, num_hash_layers: int = 0, mtp_layers: int = 0) -> Layout:
    """Balanced layout over ``stages`` (pipeline x virtual) stages, hash layers on stage 0."""
    if stages < 1:
        raise PipelineLayoutError(f"pipeline stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise PipelineLayoutError(
            f"{stages} pipeline stages for {num_layers} decoder layers leaves a stage without layers; "
            f"use at most {num_layers} stages"
        )
    if num_hash_layers > num_layers - (stages - 1):
        raise PipelineLayoutError(
            f"{num_hash_layers} hash-routed layers must all sit on stage 0, but with {stages} stages and "
            f"{num_layers} layers stage 0 can hold at most {num_layers - (stages - 1)}; use fewer stages"
        )
    base, extra = divmod(num_layers, stages)
    # Later stages carry mtp/loss, so the remainder goes to the earliest stages.
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    if counts[0] < num_hash_layers:
        counts[0] = num_hash_layers
        rest, n_rest = num_layers - num_hash_layers, stages - 1
        base, extra = divmod(rest, n_rest)
        counts[1:] = [base + (1 if s < extra else 0) for s in range(n_rest)]
    layout = []
    for s, count in enumerate(counts):
        stage = ["embedding"] if s == 0 else []
        stage += ["decoder"] * count
        if s == stages - 1:
            stage += ["mtp"] * mtp_layers + ["loss"]
        layout.append(tuple(stage))
    return tuple(layout)


def validate_pipeline_layout(layout: Layout, *, num_layers: int, num_hash_layers: int = 0, mtp_layers: int = 0) -> None:
    """Raise :class:`PipelineLayoutError` naming every rule ``layout`` breaks.

    Tokens are Megatron-Core's: ``"embedding"``, ``"decoder"``, ``"mtp"``, ``"loss"``. Rules:

    | rule | why |
    |---|---|
    | ``embedding`` on the first stage, ``mtp`` and ``loss`` on the last | the MTP layer shares the embedding and head |
    | every hash-routed layer on the first stage | ``tid2eid`` routes by input ids, which only the first stage has |
    | decoders balanced, every stage non-empty | |

    Balance is what :func:`generate_pipeline_layout` produces; this check asks only for a decoder on every stage.
    """
    problems = []
    flat = [t for stage in layout for t in stage]
    if unknown := sorted({t for t in flat if t not in TOKENS}):
        problems.append(f"unknown tokens {unknown}")
    if flat.count("decoder") != num_layers:
        problems.append(f"{flat.count('decoder')} decoder entries for {num_layers} layers")
    if not layout or "embedding" not in layout[0] or flat.count("embedding") != 1:
        problems.append("embedding must appear once, on the first stage")
    if not layout or layout[-1][-1:] != ("loss",) or flat.count("loss") != 1:
        problems.append("loss must appear once, last on the last stage")
    if flat.count("mtp") != mtp_layers or any("mtp" in stage for stage in layout[:-1]):
        problems.append(f"{mtp_layers} mtp entries must all be on the last stage")
    if layout and layout[0].count("decoder") < num_hash_layers:
        problems.append(f"stage 0 holds {layout[0].count('decoder')} decoders but {num_hash_layers} hash layers")
    if any("decoder" not in stage for stage in layout):
        problems.append("a stage has no decoder layer")
    if problems:
        raise PipelineLayoutError(f"invalid pipeline layout {layout!r}: " + "; ".join(problems))


def resolve_pipeline_layout(
    saved: Any, *, num_layers: int, stages: int, num_hash_layers: int = 0, mtp_layers: int = 0
) -> Layout:
    """Use a saved concrete layout, or regenerate when it is absent or was serialized as an object stub."""
    concrete = (
        isinstance(saved, Sequence)
        and not isinstance(saved, str)
        and all(isinstance(st, Sequence) and not isinstance(st, str) for st in saved)
        and all(isinstance(t, str) for st in saved for t in st)
    )
    if not concrete or len(saved) == 0:
        return generate_pipeline_layout(num_layers, stages, num_hash_layers=num_hash_layers, mtp_layers=mtp_layers)
    layout = tuple(tuple(stage) for stage in saved)
    if len(layout) != stages:
        raise PipelineLayoutError(f"saved layout has {len(layout)} stages but the run uses {stages}")
    validate_pipeline_layout(layout, num_layers=num_layers, num_hash_layers=num_hash_layers, mtp_layers=mtp_layers)
    return layout


def stage_layer_numbers(layout: Layout, stage: int) -> range:
    """Global decoder-layer numbers owned by ``stage``."""
    start = sum(st.count("decoder") for st in layout[:stage])
    return range(start, start + layout[stage].count("decoder"))


def _read_run_config(path: Path) -> Any:
    """``path`` as YAML; a tag the safe loader does not know (``!!python/object:...``, how an unserializable layout
    object may be written) becomes a mapping naming the tag instead of an error, so it reads as a stub."""
    import yaml

    class _StubLoader(yaml.SafeLoader):
        pass

    _StubLoader.add_multi_constructor("", lambda loader, suffix, node: {"_unresolved_tag_": node.tag})
    try:
        return yaml.load(path.read_text(), Loader=_StubLoader)  # a SafeLoader: builds no Python objects
    except (OSError, yaml.YAMLError) as exc:
        raise PipelineLayoutError(f"{path}: cannot read the saved run configuration ({exc})") from exc


def saved_pipeline_layout(run_dir: str | Path) -> Any:
    """``model.pipeline_model_parallel_layout`` as a saved run recorded it: the first concrete (list) layout in
    ``run_dir/run_config.yaml`` or an ``iter_*/run_config.yaml`` (newest first); else whatever was recorded (None,
    or the object stub a serializer left), which :func:`resolve_pipeline_layout` regenerates."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PipelineLayoutError(f"{root}: no saved run directory to read {RUN_CONFIG} from")
    candidates = [root, *sorted(root.glob("iter_*"), reverse=True)]
    recorded: Any = None
    for config_path in (c / RUN_CONFIG for c in candidates):
        if not config_path.is_file():
            continue
        config = _read_run_config(config_path)
        model = config.get("model") if isinstance(config, dict) else None
        saved = model.get("pipeline_model_parallel_layout") if isinstance(model, dict) else None
        if isinstance(saved, list):
            return saved
        recorded = recorded if saved is None else saved
    return recorded


def run_pipeline_layout(
    run_dir: str | Path, *, num_layers: int, stages: int, num_hash_layers: int = 0, mtp_layers: int = 0
) -> Layout:
    """The layout to load (and export) a saved run with: its recorded layout, or, when ``run_config.yaml`` lost it
    (an object stub, null, absent), the regenerated one (Megatron-Bridge #4306)."""
    return resolve_pipeline_layout(
        saved_pipeline_layout(run_dir),
        num_layers=num_layers,
        stages=stages,
        num_hash_layers=num_hash_layers,
        mtp_layers=mtp_layers,
    )

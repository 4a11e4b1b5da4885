"""``dsv4-lora convert-adapter``: a pickled PEFT adapter (``adapter_model.bin`` / ``*.pt``) as safetensors.

``verify-adapter`` and the export never unpickle anything, because loading a pickle can run code; this explicit
command is the way forward, loading with ``weights_only=True`` (:func:`convert_adapter`). The result is still
uncertified: nothing proves its base. A folder of native LoRA shards is reassembled and published by the export
itself (:func:`convert_native_shards`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from impl.cli import output
from impl.cli.command_text import add_command
from impl.errors import ConfigFileError, Dsv4Error, PickleAdapterError

PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt")


def _pickle_file(src: Path) -> Path:
    for name in PICKLE_NAMES:
        if (src / name).is_file():
            return src / name
    found = sorted(p for pattern in ("*.bin", "*.pt") for p in src.glob(pattern))
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        raise PickleAdapterError(f"{src}: expected one pickled adapter file (adapter_model.bin or *.pt), found {what}")
    return found[0]


def _describe(obj: Any) -> str:
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}"
    import torch

    odd = [(k, v) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    k, v = odd[0]
    return f"a dict with {len(odd)} entries that are no name -> tensor pair, e.g. {k!r}: {type(v).__name__}"


def load_pickled_tensors(file: Path) -> dict:
    """The flat ``{name: tensor}`` dict in ``file``, loaded with ``weights_only=True``; typed error otherwise."""
    import torch

    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses code-carrying pickles; a corrupt file fails too
        raise PickleAdapterError(
            f"{file}: torch.load(weights_only=True) refused it ({type(exc).__name__}: {str(exc)[:300]})"
        ) from None
    if (
        not isinstance(obj, dict)
        or not obj
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    ):
        found = "an empty dict" if isinstance(obj, dict) and not obj else _describe(obj)
        raise PickleAdapterError(f"{file}: holds {found}, not a flat dict of tensors (name -> tensor)")
    return {k: v.detach().clone().contiguous() for k, v in obj.items()}


def convert_adapter(src: str | Path, out: str | Path) -> Path:
    """Convert the pickled adapter in ``src`` to a safetensors adapter directory ``out``; returns ``out``.

    It loads the pickle with ``torch.load(..., weights_only=True)`` (tensors and plain containers only), refuses
    anything but a flat ``{name: tensor}`` dict (:class:`impl.errors.PickleAdapterError` naming what it found), and
    publishes ``adapter_model.safetensors`` beside the unchanged ``adapter_config.json`` through the export's
    fail-closed atomic path (:func:`impl.adapter.files.publish_files`). The result is still uncertified (nothing
    proves its base); ``dsv4-lora export --adapter OUT --consumer ...`` re-publishes it for a consumer.
    """
    from safetensors.torch import save

    from impl.adapter.files import ADAPTER_FILE, CONFIG_FILE, publish_files

    src = Path(src)
    config = src / CONFIG_FILE
    if not config.is_file():
        raise ConfigFileError(f"{config}: missing; a PEFT adapter directory holds its adapter_config.json")
    tensors = load_pickled_tensors(_pickle_file(src))
    payload = save(tensors, metadata={"format": "pt"})
    return publish_files(out, {ADAPTER_FILE: payload, CONFIG_FILE: config.read_bytes()}, dialect="unrecorded")


def _native_alpha(src: Path, alpha: float | None) -> float:
    """The run's LoRA alpha: given, or from the ``adapter_config.json`` Miles writes beside its shards."""
    import json

    if alpha is not None:
        return alpha
    config = src / "adapter_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("lora_alpha")
        if isinstance(value, int | float) and value > 0:
            return float(value)
    raise ConfigFileError(
        f"{src}: native shards do not hold LoRA alpha, and there is no adapter_config.json with lora_alpha beside "
        "them; give --alpha as the run used it"
    )


def convert_native_shards(src: str | Path, out: str | Path, args: argparse.Namespace) -> Path:
    """Reassemble native LoRA shards into one adapter and publish it with the fail-closed export.

    The folder holds Miles' ``adapter_megatron_tp{t}_pp{p}.pt`` / ``adapter_megatron_rank{r}.pt``, one per rank
    (:mod:`impl.adapter.native_shards`); shapes are checked against ``--base`` when given, and the adapter is
    published in the dialect asked for.
    """
    from impl.adapter.export import export_adapter
    from impl.adapter.native_shards import read_native_shards

    src = Path(src)
    state = read_native_shards(src, alpha=_native_alpha(src, args.alpha), tp=args.tp, pp=args.pp)
    shapes = None
    if args.base:
        from impl.conversion.headers import read_headers

        shapes = {n: h.shape for n, h in read_headers(Path(args.base))[0].items()}
    return export_adapter(
        state, out, dialect=args.dialect, base_shapes=shapes, base_model_name_or_path=args.base, timeout_s=60
    )


def cmd_convert(args: argparse.Namespace) -> int:
    from impl.adapter.native_shards import is_native_shard_dir

    if args.source == "native-shards" or (args.source == "auto" and is_native_shard_dir(Path(args.adapter))):
        try:
            out = convert_native_shards(args.adapter, args.out, args)
        except Dsv4Error as exc:  # the export wraps its phases' errors: name the cause, not the wrapper
            cause = exc.__cause__ if isinstance(exc.__cause__, Dsv4Error) else exc
            output.problem(f"convert-adapter FAILED: {type(cause).__name__}: {cause}")
            return 1
        print(f"reassembled the native shards of {args.adapter} into {out} ({args.dialect} dialect)")
    else:
        out = convert_adapter(args.adapter, args.out)
        print(f"converted {args.adapter} to {out} (adapter_model.safetensors; adapter_config.json unchanged)")
    print(f"next: dsv4-lora verify-adapter --base BASE --adapter {out}")
    return 0


def add_convert_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``dsv4-lora convert-adapter``."""
    c = add_command(sub, "convert-adapter", parents)
    c.add_argument(
        "--adapter",
        required=True,
        help="PEFT adapter directory holding adapter_model.bin (or *.pt), or a folder of native LoRA shards "
        "(adapter_megatron_tp{t}_pp{p}.pt / adapter_megatron_rank{r}.pt)",
    )
    c.add_argument("--out", required=True, help="destination directory (replaced atomically)")
    c.add_argument(
        "--from",
        dest="source",
        choices=("auto", "peft-pickle", "native-shards"),
        default="auto",
        help="what --adapter holds (auto: native shards where there are any)",
    )
    c.add_argument("--alpha", type=float, help="native shards: the run's LoRA alpha (else adapter_config.json's)")
    c.add_argument("--tp", type=int, help="native shards named by rank: the run's tensor-parallel size")
    c.add_argument("--pp", type=int, help="native shards named by rank: the run's pipeline-parallel size")
    c.add_argument("--base", help="native shards: the base checkpoint, to check every shape against it")
    c.add_argument(
        "--dialect", default="transformers", choices=("transformers", "official", "sglang"), help="native shards"
    )
    c.set_defaults(func=cmd_convert)

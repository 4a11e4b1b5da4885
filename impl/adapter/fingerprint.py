"""Fingerprint of the frozen base an adapter was trained against.

A fingerprint records a hash of the base config and, for each targeted base tensor (official checkpoint name,
plus its ``.scale`` companion when quantized), its shape, dtype and the sha256 of its raw bytes. It is stored in
the adapter's ``adapter_model.safetensors`` header under ``dsv4_base_fingerprint`` (not in
``adapter_config.json``: PEFT's ``from_peft_type`` drops unknown keys with an "upgrade PEFT" warning, and rollout
engines parse that file too), so it travels inseparably with the tensors.

Reading a checkpoint directory opens only the shards that hold targeted tensors and reads only those tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from impl.adapter.dialects import DIALECTS
from impl.errors import Dsv4Error
from impl.lora.vocabulary import TARGET_TABLE

FINGERPRINT_VERSION = 1
METADATA_KEY = "dsv4_base_fingerprint"
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})


class FingerprintMismatchError(Dsv4Error, ValueError):
    """The adapter was trained against a different base (the differing tensors are named)."""


def config_sha256(config: Mapping[str, Any] | None) -> str | None:
    """sha256 of the canonical JSON of a base config, ignoring keys that change on a mere re-save."""
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    clean = {k: v for k, v in dict(config).items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def tensor_record(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and sha256 of the raw bytes of one tensor."""
    t = tensor.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sha256": hashlib.sha256(raw.numpy().data).hexdigest(),
    }


def _transformers_alias(official: str) -> str | None:
    """The transformers state-dict name of an official attention weight name (None when not a target)."""
    off, tf = DIALECTS["official"], DIALECTS["transformers"]
    for row in TARGET_TABLE.main:
        for suffix in (".weight",):
            parts = official.split(".")
            if len(parts) == 5 and parts[0] == "layers" and parts[2] == "attn" and parts[3] == off.leaf(row):
                return tf.module_name(int(parts[1]), row) + suffix
    return None


def _lookup(available: Iterable[str], name: str) -> str | None:
    available = set(available)
    if name in available:
        return name
    alias = _transformers_alias(name)
    return alias if alias is not None and alias in available else None


def _with_companions(names: Iterable[str], available: set[str]) -> list[str]:
    out = []
    for n in names:
        out.append(n)
        scale = n.removesuffix(".weight") + ".scale"
        if n.endswith(".weight") and scale in available and scale not in names:
            out.append(scale)
    return out


def _dir_sources(path: Path, names: list[str]) -> tuple[dict[str, Path], set[str]]:
    """Map each wanted name to the shard holding it, reading only the index (or shard headers)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}, set(weight_map)
    where: dict[str, Path] = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:  # header only
            for k in f.keys():
                where[k] = shard
    return where, set(where)


def base_fingerprint(
    base: str | os.PathLike | Mapping[str, torch.Tensor],
    names: Iterable[str],
    *,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Fingerprint of the base tensors ``names`` (official names like ``layers.0.attn.wq_a.weight``).

    ``base`` is a checkpoint directory (official or transformers names; ``config.json`` is hashed when present)
    or an in-memory state dict (pass ``config`` to hash it). Quantized ``.scale`` companions are included.
    Raises :class:`FingerprintMismatchError` when a named tensor is absent from the base.
    """
    from safetensors import safe_open

    names = list(dict.fromkeys(names))
    records: dict[str, Any] = {}
    if isinstance(base, Mapping):
        available = set(base)
        missing = [n for n in names if _lookup(available, n) is None]
        if missing:
            raise FingerprintMismatchError(f"base state has no tensor for {missing}; is it the right base model?")
        for n in _with_companions(names, available):
            records[n] = tensor_record(base[_lookup(available, n)])
        return {"version": FINGERPRINT_VERSION, "config_sha256": config_sha256(config), "tensors": records}

    path = Path(base)
    where, available = _dir_sources(path, names)
    missing = [n for n in names if _lookup(available, n) is None]
    if missing:
        raise FingerprintMismatchError(f"base checkpoint {path} has no tensor for {missing}; is it the right base?")
    wanted = _with_companions(names, available)
    by_shard: dict[Path, list[str]] = {}
    for n in wanted:
        by_shard.setdefault(where[_lookup(available, n)], []).append(n)
    for shard, shard_names in sorted(by_shard.items()):
        with safe_open(str(shard), framework="pt") as f:
            for n in shard_names:
                records[n] = tensor_record(f.get_tensor(_lookup(available, n)))
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text()) if config is None and cfg_file.is_file() else config
    ordered = {n: records[n] for n in wanted}
    return {"version": FINGERPRINT_VERSION, "config_sha256": config_sha256(cfg), "tensors": ordered}


def read_adapter_fingerprint(adapter_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The fingerprint recorded in an exported adapter (None when it was exported without one)."""
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), framework="pt") as f:
        meta = f.metadata() or {}
    raw = meta.get(METADATA_KEY)
    return json.loads(raw) if raw else None


def compare_fingerprints(recorded: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Human-readable differences (empty when the bases agree)."""
    diffs = []
    rc, ac = recorded.get("config_sha256"), actual.get("config_sha256")
    if rc is not None and ac is not None and rc != ac:
        diffs.append(f"config.json: sha256 {rc[:12]}… recorded, {ac[:12]}… in this base")
    for name, rec in recorded["tensors"].items():
        got = actual["tensors"].get(name)
        if got is None:
            diffs.append(f"{name}: absent from this base")
            continue
        for field in ("shape", "dtype", "sha256"):
            if rec[field] != got[field]:
                diffs.append(f"{name}: {field} {rec[field]} recorded, {got[field]} in this base")
                break
    return diffs


def verify_fingerprint(
    adapter: str | os.PathLike | Mapping[str, Any],
    base: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`FingerprintMismatchError` naming every differing tensor when ``adapter`` (an exported
    directory or a fingerprint dict) was trained against a base other than ``base``."""
    recorded = adapter if isinstance(adapter, Mapping) else read_adapter_fingerprint(adapter)
    if recorded is None:
        raise FingerprintMismatchError(
            f"adapter {adapter} carries no base fingerprint; re-export it with base_fingerprint=... to verify"
        )
    names = list(recorded["tensors"])
    try:
        actual = base_fingerprint(base, [n for n in names if not n.endswith(".scale")], config=config)
    except FingerprintMismatchError as err:
        raise FingerprintMismatchError(f"adapter does not match base {base}: {err}") from None
    diffs = compare_fingerprints(recorded, actual)
    if diffs:
        raise FingerprintMismatchError(
            f"adapter was trained against a different base than {base if not isinstance(base, Mapping) else 'the given state'}"
            f" ({len(diffs)} difference(s)): " + "; ".join(diffs) + ". Load it on the base it was trained on."
        )

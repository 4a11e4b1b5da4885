"""Fingerprint of the frozen base an adapter was trained against, so an adapter is refused on another base.

It records the base config's hash and each targeted base tensor's shape, dtype and digests, and lives in the
``adapter_model.safetensors`` header, never in ``adapter_config.json``, so it travels with the tensors. Reading a base
opens only the shards that hold targeted tensors and streams their bytes, so memory stays flat. A sampled check can
miss a change confined to unsampled bytes and says which way each tensor was compared. Format: docs/fingerprint.md."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from impl.adapter.dialects import DIALECTS
from impl.adapter.raw import DTYPE_NAMES
from impl.conversion.digests import remembered_digests, tensor_digests
from impl.conversion.headers import (
    SAMPLED_ABOVE,
    Header,
    read_file_header,
    sample_sha256,
    shard_files,
    tensor_sample_sha256,
)
from impl.errors import FingerprintMismatchError
from impl.vocabulary import TARGET_TABLE

if TYPE_CHECKING:
    import torch

__all__ = [
    "base_fingerprint",
    "read_adapter_fingerprint",
    "verify_fingerprint",
]

FINGERPRINT_VERSION = 1
METADATA_KEY = "dsv4_base_fingerprint"
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
#: safetensors dtype -> the torch dtype name a record carries (what a loaded tensor's dtype prints as)
TORCH_DTYPE_NAMES = DTYPE_NAMES


class FingerprintCheck(NamedTuple):
    """How a verified fingerprint's tensors were compared: by every byte, or by their sampled pages."""

    full: int
    sampled: int


def config_sha256(config: Mapping[str, Any] | None) -> str | None:
    """sha256 of the canonical JSON of a base config, ignoring keys that change on a mere re-save."""
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    clean = _expert_dtype_on_top({k: v for k, v in dict(config).items() if k not in _VOLATILE_CONFIG_KEYS})
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def _expert_dtype_on_top(config: dict[str, Any]) -> dict[str, Any]:
    """``expert_dtype`` read from either place: the released config has it at the top, transformers >= 5.23's
    ``DeepseekV4Config.__post_init__`` moves it into ``quantization_config``, so a re-save moves it there."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or "expert_dtype" not in quant:
        return config
    if config.setdefault("expert_dtype", quant["expert_dtype"]) != quant["expert_dtype"]:
        return config  # two different values: a different config, hashed as it is
    rest = {k: v for k, v in quant.items() if k != "expert_dtype"}
    if rest:
        config["quantization_config"] = rest
    else:
        config.pop("quantization_config")
    return config


def tensor_record(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and sha256 of the raw bytes of one tensor."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    raw = (t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)).numpy().data
    record = {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    if raw.nbytes > SAMPLED_ABOVE:
        record["sample_sha256"] = sample_sha256(raw)
    return record


def _transformers_alias(official: str) -> str | None:
    """The transformers state-dict name of an official attention weight name (None when not a target)."""
    off, tf = DIALECTS["official"], DIALECTS["transformers"]
    for row in TARGET_TABLE.main:
        for suffix in (".weight",):
            parts = official.split(".")
            if len(parts) == 5 and parts[0] == "layers" and parts[2] == "attn" and parts[3] == off.leaf(row):
                return tf.module_name(int(parts[1]), row) + suffix
    return None


def _lookup(available: set[str] | Mapping[str, Any], name: str) -> str | None:
    if name in available:
        return name
    alias = _transformers_alias(name)
    return alias if alias is not None and alias in available else None


def _with_companions(names: Iterable[str], available: set[str] | Mapping[str, Any]) -> list[str]:
    out = []
    for n in names:
        out.append(n)
        scale = n.removesuffix(".weight") + ".scale"
        if n.endswith(".weight") and scale in available and scale not in names:
            out.append(scale)
    return out


def _dir_sources(path: Path) -> dict[str, tuple[str, str]]:
    """Each tensor's official name -> (its stored name, the shard file holding it), from the index (or, without
    one, every shard's header); a base in another writer's naming is read as official (``read_as_official``)."""
    from impl.conversion.layouts import read_as_official

    index = path / "model.safetensors.index.json"
    if index.is_file():
        stored = dict(json.loads(index.read_text())["weight_map"])
    else:
        stored = {name: h.file for f in shard_files(path) for name, h in read_file_header(f)}
    _, official, _ = read_as_official(stored)
    return {o: (s, stored[s]) for o, s in official.items()}


def _dir_records(
    path: Path, wanted: list[str], where: dict[str, tuple[str, str]], sampled: Collection[str]
) -> dict[str, Any]:
    """Records of ``wanted`` from their shards' headers, each tensor's bytes streamed (never loaded) or its digest
    remembered from an earlier run while its shard is unchanged (:mod:`impl.conversion.digests`); a large tensor
    in ``sampled`` whose digest is not remembered gets its sample's digest only."""
    by_shard: dict[str, list[str]] = {}
    for n in wanted:
        by_shard.setdefault(where[n][1], []).append(n)
    found: dict[str, Header] = {}
    for shard, shard_names in sorted(by_shard.items()):
        headers = dict(read_file_header(path / shard))
        for n in shard_names:
            h = headers.get(where[n][0])
            if h is None:
                raise FingerprintMismatchError(f"{path / shard}: has no tensor {n} although the index says it does")
            found[n] = h
    big = {n for n, h in found.items() if h.span[1] - h.span[0] > SAMPLED_ABOVE}
    known = remembered_digests(path, {n: found[n] for n in big & set(sampled)})
    only_sampled = {n for n in big & set(sampled) if n not in known}
    known |= tensor_digests(path, {n: h for n, h in found.items() if n not in only_sampled and n not in known})
    records = {}
    for n, h in found.items():
        record: dict[str, Any] = {"shape": list(h.shape), "dtype": TORCH_DTYPE_NAMES.get(h.dtype, h.dtype)}
        if n in known:
            record["sha256"] = known[n]
        if n in big and (n in only_sampled or not sampled):
            record["sample_sha256"] = tensor_sample_sha256(path, h)
        records[n] = record
    return records


def base_fingerprint(
    base: str | os.PathLike | Mapping[str, torch.Tensor],
    names: Iterable[str],
    *,
    config: Mapping[str, Any] | None = None,
    sampled: Collection[str] = (),
) -> dict[str, Any]:
    """Fingerprint of the base tensors ``names`` (official names like ``layers.0.attn.wq_a.weight``).

    ``base`` is a checkpoint directory (official or transformers names; ``config.json`` is hashed when present)
    or an in-memory state dict (pass ``config`` to hash it). Quantized ``.scale`` companions are included.
    With ``sampled`` (names, companions included, of a checkpoint directory), a large tensor named there whose
    full digest is not remembered is recorded by its sample only: for comparing, never for recording.
    Raises :class:`FingerprintMismatchError` when a named tensor is absent from the base.
    """
    names = list(dict.fromkeys(names))
    if isinstance(base, Mapping):
        records: dict[str, Any] = {}
        available = set(base)
        missing = [n for n in names if _lookup(available, n) is None]
        if missing:
            raise FingerprintMismatchError(f"base state has no tensor for {missing}; is it the right base model?")
        for n in _with_companions(names, available):
            records[n] = tensor_record(base[_lookup(available, n)])
        return {"version": FINGERPRINT_VERSION, "config_sha256": config_sha256(config), "tensors": records}

    path = Path(base)
    where = _dir_sources(path)
    missing = [n for n in names if n not in where]
    if missing:
        raise FingerprintMismatchError(f"base checkpoint {path} has no tensor for {missing}; is it the right base?")
    wanted = _with_companions(names, where)
    records = _dir_records(path, wanted, where, sampled)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text()) if config is None and cfg_file.is_file() else config
    ordered = {n: records[n] for n in wanted}
    return {"version": FINGERPRINT_VERSION, "config_sha256": config_sha256(cfg), "tensors": ordered}


def read_adapter_fingerprint(adapter_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The fingerprint recorded in an exported adapter (None when it was exported without one)."""
    from impl.adapter.raw import read_metadata

    raw = read_metadata(Path(adapter_dir) / "adapter_model.safetensors").get(METADATA_KEY)
    return json.loads(raw) if raw else None


def compare_fingerprints(recorded: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Human-readable differences (empty when the bases agree): each tensor by its full digest where ``actual``
    has one, else by its sample's."""
    diffs = []
    rc, ac = recorded.get("config_sha256"), actual.get("config_sha256")
    if rc is not None and ac is not None and rc != ac:
        diffs.append(f"config.json: sha256 {rc[:12]}… recorded, {ac[:12]}… in this base")
    for name, rec in recorded["tensors"].items():
        got = actual["tensors"].get(name)
        if got is None:
            diffs.append(f"{name}: absent from this base")
            continue
        digest = "sha256" if "sha256" in got else "sample_sha256"
        for field in ("shape", "dtype", digest):
            if rec.get(field) != got[field]:
                diffs.append(f"{name}: {field} {rec.get(field)} recorded, {got[field]} in this base")
                break
    return diffs


def verify_fingerprint(
    adapter: str | os.PathLike | Mapping[str, Any],
    base: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any] | None = None,
    sampled: bool = False,
) -> FingerprintCheck:
    """Raise :class:`FingerprintMismatchError` naming every differing tensor when ``adapter`` (an exported
    directory or a fingerprint dict) was trained against a base other than ``base``. ``sampled``: a large tensor
    whose full digest is not remembered is compared by its recorded sample (where one is recorded)."""
    recorded = adapter if isinstance(adapter, Mapping) else read_adapter_fingerprint(adapter)
    if recorded is None:
        raise FingerprintMismatchError(
            f"adapter {adapter} carries no base fingerprint; re-export it with base_fingerprint=... to verify"
        )
    names = list(recorded["tensors"])
    by_sample = [n for n, r in recorded["tensors"].items() if "sample_sha256" in r] if sampled else []
    try:
        actual = base_fingerprint(
            base, [n for n in names if not n.endswith(".scale")], config=config, sampled=by_sample
        )
    except FingerprintMismatchError as err:
        raise FingerprintMismatchError(f"adapter does not match base {base}: {err}") from None
    diffs = compare_fingerprints(recorded, actual)
    if diffs:
        raise FingerprintMismatchError(
            f"adapter was trained against a different base than {base if not isinstance(base, Mapping) else 'the given state'}"
            f" ({len(diffs)} difference(s)): " + "; ".join(diffs) + ". Load it on the base it was trained on."
        )
    full = sum("sha256" in actual["tensors"].get(n, {}) for n in names)
    return FingerprintCheck(full=full, sampled=len(names) - full)

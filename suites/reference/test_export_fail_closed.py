"""An empty, partial, mis-shaped or corrupt adapter state is refused with a typed error naming the tensor,
and nothing is published: the destination stays exactly as it was."""

from __future__ import annotations

import math

import pytest
import torch

from fixtures.data.adapter_states import (
    attention_shapes,
    make_native_adapter,
    snapshot_tree,
    tampering_the_staged_file,
)

pytestmark = pytest.mark.cpu

SHAPES = attention_shapes(hidden=64, q_lora=48, heads=4, head_dim=32, o_groups=2, o_lora=16)
R = 4
A0 = "decoder.layers.0.self_attention.wq_b.adapter.linear_in.weight"
B0 = "decoder.layers.0.self_attention.wq_b.adapter.linear_out.weight"


@pytest.fixture(scope="module")
def api(impl):
    return impl


def _good() -> dict[str, torch.Tensor]:
    return make_native_adapter(SHAPES, 2, R)


def _base_shapes() -> dict[str, tuple[int, int]]:
    return {f"layers.{i}.attn.{leaf}.weight": s for i in range(2) for leaf, s in SHAPES.items()}


def _without(d, *names):
    return {k: v for k, v in d.items() if k not in names}


CASES = {
    "no-tensors": (lambda: {}, {}, "EmptyAdapterError", "no tensors"),
    "declared-target-without-tensors": (
        lambda: {k: v for k, v in _good().items() if ".wkv." not in k},
        {"targets": tuple(SHAPES)},
        "EmptyAdapterError",
        "'wkv' has no tensors",
    ),
    "target-missing-in-one-layer": (
        lambda: {k: v for k, v in _good().items() if "layers.1.self_attention.wo_b" not in k},
        {"targets": tuple(SHAPES), "num_layers": 2},
        "EmptyAdapterError",
        r"'wo_b' has no tensors in layer 1",
    ),
    "lora-B-missing": (lambda: _without(_good(), B0), {}, "MissingAdapterHalfError", A0.replace(".", r"\.")),
    "lora-A-missing": (lambda: _without(_good(), A0), {}, "MissingAdapterHalfError", B0.replace(".", r"\.")),
    "B-rows-disagree-with-base": (
        lambda: {**_good(), B0: torch.zeros(SHAPES["wq_b"][0] + 1, R)},
        {},
        "AdapterShapeError",
        r"layers\.0\.attn\.wq_b\.weight",
    ),
    "A-rank-disagrees-with-r": (
        lambda: {**_good(), A0: torch.zeros(R + 1, SHAPES["wq_b"][1])},
        {},
        "AdapterShapeError",
        r"r=4",
    ),
    "nan-in-lora-B": (
        lambda: {**_good(), B0: torch.full((SHAPES["wq_b"][0], R), float("nan"))},
        {},
        "NonFiniteAdapterError",
        B0.replace(".", r"\."),
    ),
    "inf-in-lora-A": (
        lambda: {**_good(), A0: torch.full((R, SHAPES["wq_b"][1]), float("inf"))},
        {},
        "NonFiniteAdapterError",
        A0.replace(".", r"\."),
    ),
    "non-attention-tensor": (
        lambda: {**_good(), "decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight": torch.zeros(R, 64)},
        {},
        "ExportError",
        r"mlp\.linear_fc1",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_state_is_refused_in_memory_naming_the_tensor(api, case) -> None:
    make, kw, err, match = CASES[case]
    with pytest.raises(api.ExportError, match=match) as info:
        api.publish_in_memory(api.AdapterState(make(), r=R, alpha=8.0, **kw), base_shapes=_base_shapes())
    assert type(info.value).__name__ == err, f"{case}: raised {type(info.value).__name__}, expected {err}"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_state_publishes_no_file_and_leaves_an_earlier_export_intact(api, case, tmp_path) -> None:
    make, kw, err, match = CASES[case]
    out = tmp_path / "adapter"
    api.export_adapter(api.AdapterState(_good(), r=R, alpha=8.0), out)
    before = snapshot_tree(out)
    with pytest.raises(api.ExportError, match=match) as info:
        api.export_adapter(api.AdapterState(make(), r=R, alpha=8.0, **kw), out, base_shapes=_base_shapes())
    assert type(info.value.__cause__).__name__ == err, f"{case}: cause {info.value.__cause__!r}"
    assert "rank 0: " + err in str(info.value), str(info.value)
    assert snapshot_tree(out) == before, f"{case}: the destination or its parent changed"


def test_bad_adapter_into_a_fresh_destination_creates_nothing(api, tmp_path) -> None:
    out = tmp_path / "sub" / "adapter"
    with pytest.raises(api.ExportError):
        api.export_adapter(api.AdapterState({}, r=R, alpha=8.0), out)
    assert not out.exists() and (not out.parent.exists() or not any(out.parent.iterdir())), "export left files behind"


def test_multi_lora_export_is_unsupported(api) -> None:
    two = {"a": api.AdapterState(_good(), r=R, alpha=8.0), "b": api.AdapterState(_good(), r=R, alpha=8.0)}
    with pytest.raises(api.MultiLoRAUnsupportedError, match="multi-LoRA"):
        api.publish_in_memory(two)


def _flip_last_data_byte(path) -> str:
    """Flip one bit of the last byte of the tensor stored last; returns its name."""
    import json
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        name, entry = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1])
        f.seek(8 + n + entry["data_offsets"][1] - 1)
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0x01]))
    return f"tensor {name} on disk differs"


def _reorder_header(path) -> str:
    """Rewrite the header with its entries in reverse order: the same tensors at the same offsets, the same
    length, so every safetensors reader sees the same file, yet other bytes than the ones written."""
    import json
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        header = json.loads(raw)
        text = json.dumps(dict(reversed(header.items())), separators=(",", ":"), ensure_ascii=False).encode()
        assert len(text) <= n and text != raw.rstrip(b" "), "the header cannot be reordered in place"
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
    return "header"


def _reorder_entry_keys(path) -> str:
    """Rewrite each tensor's header entry with ``data_offsets`` first: the same header, the same length, in bytes
    that sort before the ones written (where :func:`_reorder_header`'s sort after them), so a comparison that only
    looked one way would miss one of the two."""
    import json
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        header = json.loads(raw)
        moved = {k: v if k == "__metadata__" else {"data_offsets": v["data_offsets"], **v} for k, v in header.items()}
        text = json.dumps(moved, separators=(",", ":"), ensure_ascii=False).encode()
        assert len(text) <= n and text < raw, "the entries cannot be reordered in place into lower bytes"
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
    return "header"


@pytest.mark.parametrize(
    "tamper",
    [_flip_last_data_byte, _reorder_header, _reorder_entry_keys],
    ids=["tensor-bytes", "header-bytes", "header-bytes-sorting-lower"],
)
def test_a_staged_file_that_differs_from_what_was_written_is_never_published(api, tmp_path, tamper) -> None:
    """The writer's output is re-read before publishing: a flipped bit in a tensor's data, or a header that says
    the same in other bytes (``.complete`` would certify a hash the file does not have), fails the export naming
    what differs, and the earlier export stays as it was. The change is made between the write phase and the next."""
    out = tmp_path / "adapter"
    api.export_adapter(api.AdapterState(_good(), r=R, alpha=8.0), out)
    before = snapshot_tree(out)
    phases, said = tampering_the_staged_file(api.EXPORT_PHASES, tmp_path, out, tamper)
    with pytest.raises(api.CollectiveExportError, match="phase validate") as info:
        api.export_adapter(api.AdapterState(_good(), r=R, alpha=9.0), out, phases=phases)
    assert said, (
        "the write phase left no staged adapter_model.safetensors beside the destination: the test proves nothing"
    )
    assert said[0] in str(info.value), str(info.value)
    assert snapshot_tree(out) == before, "a corrupt staged adapter changed the destination"


def test_a_staged_config_that_differs_from_the_built_one_is_never_published(api, tmp_path, monkeypatch) -> None:
    """The staged ``adapter_config.json`` is re-read too: when the file on disk no longer says what was built (here
    its ``lora_alpha`` changes while the writer makes it durable), the export fails naming that file, and the
    earlier export stays as it was."""
    import json
    import os
    import threading

    out = tmp_path / "adapter"
    api.export_adapter(api.AdapterState(_good(), r=R, alpha=8.0), out)
    before = snapshot_tree(out)
    real_fsync, tampered, once = os.fsync, [], threading.Lock()

    def fsync_then_tamper(fd: int) -> None:
        """Once a config other than the published one exists under the destination's parent (the staged one,
        whatever the exporter calls its staging area), rewrite it with another lora_alpha (once, even when the
        exporter syncs from several threads)."""
        real_fsync(fd)
        with once:
            staged = [p for p in tmp_path.rglob("adapter_config.json") if p != out / "adapter_config.json"]
            if staged and not tampered:
                config = json.loads(staged[0].read_text())
                staged[0].write_text(json.dumps({**config, "lora_alpha": 99.0}, indent=2, sort_keys=True) + "\n")
                tampered.append(staged[0])

    monkeypatch.setattr(os, "fsync", fsync_then_tamper)
    with pytest.raises(api.CollectiveExportError, match="adapter_config.json") as info:
        api.export_adapter(api.AdapterState(_good(), r=R, alpha=9.0), out)
    monkeypatch.undo()
    assert tampered, "the export never made its staged adapter_config.json durable: the test proves nothing"
    assert "phase validate" in str(info.value), str(info.value)
    assert snapshot_tree(out) == before, "a staged config that differs from the export changed the destination"


def test_a_cleanup_failure_after_the_commit_point_warns_and_keeps_the_committed_export(
    api, tmp_path, monkeypatch
) -> None:
    """Deleting the replaced export happens after the commit point: its failure cannot un-commit, so it is a
    RuntimeWarning (the next export's recovery deletes the leftover), not an export error."""
    import shutil

    out = tmp_path / "adapter"
    api.export_adapter(api.AdapterState(_good(), r=R, alpha=8.0), out)
    real_rmtree = shutil.rmtree

    def rmtree_failing_on_trash(path, *args, **kwargs):
        if str(path).endswith(".dsv4-trash") and not kwargs.get("ignore_errors"):
            raise OSError("device busy (injected)")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_failing_on_trash)
    with pytest.warns(RuntimeWarning, match=r"is committed, but cleaning up after the commit failed.*device busy"):
        api.export_adapter(api.AdapterState(_good(), r=R, alpha=9.0), out)
    monkeypatch.undo()
    assert api.validate_adapter_dir(out)["config"]["lora_alpha"] == 9.0, "the committed export is not the new one"
    assert (tmp_path / ".adapter.dsv4-trash").exists(), "the injected cleanup failure did not happen"
    api.export_adapter(api.AdapterState(_good(), r=R, alpha=10.0), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "the next export did not clean up"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "bad", [float("nan"), -float("nan"), float("inf"), float("-inf")], ids=["nan", "-nan", "inf", "-inf"]
)
def test_a_non_finite_value_past_the_first_chunk_is_refused_by_the_file_export(api, tmp_path, dtype, bad) -> None:
    """The file export checks the finiteness of every byte it publishes: the last element of a tensor several
    8 MiB write chunks long must be seen, in every floating dtype the checker reads by its bits, whatever the
    sign bit of the NaN or Inf."""
    tensors = {k: v.to(dtype) for k, v in _good().items()}
    big = torch.zeros(3_000_000, R, dtype=dtype)  # 24-48 MB: several 8 MiB chunks
    big[-1, -1] = bad
    if math.copysign(1.0, bad) < 0:  # a cast may drop a NaN's sign: set the sign bit itself
        as_int = big.view({2: torch.int16, 4: torch.int32}[big.element_size()])
        as_int[-1, -1] |= torch.iinfo(as_int.dtype).min
    assert bool(big[-1, -1].signbit()) == (math.copysign(1.0, bad) < 0), "the bad value's sign bit is not as meant"
    assert not torch.isfinite(big[-1, -1].float()), "the bad value is finite: the case tests nothing"
    tensors[B0] = big
    out = tmp_path / "adapter"
    with pytest.raises(api.CollectiveExportError, match=B0.replace(".", r"\.") + r".*NaN/Inf") as info:
        api.export_adapter(api.AdapterState(tensors, r=R, alpha=8.0), out)
    assert type(info.value.__cause__).__name__ == "NonFiniteAdapterError", repr(info.value.__cause__)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [], "the refused export left files"
    big[-1, -1] = 1.0
    api.export_adapter(api.AdapterState(tensors, r=R, alpha=8.0), out)  # the same state, finite, exports


def test_a_float64_adapter_is_published_and_a_nan_in_it_is_refused(api, tmp_path) -> None:
    """float64, a dtype the export accepts beyond the ones whose exponent bits it reads directly, is published when
    finite and refused, naming the tensor, when it holds a NaN."""
    tensors = {k: v.to(torch.float64) for k, v in _good().items()}
    out = tmp_path / "adapter"
    api.export_adapter(api.AdapterState(tensors, r=R, alpha=8.0), out)
    assert api.validate_adapter_dir(out)["config"]["lora_alpha"] == 8.0, "the float64 adapter was not published"
    before = snapshot_tree(out)
    tensors[B0] = tensors[B0].clone()
    tensors[B0][-1, -1] = float("nan")
    with pytest.raises(api.CollectiveExportError, match=B0.replace(".", r"\.") + r".*NaN/Inf"):
        api.export_adapter(api.AdapterState(tensors, r=R, alpha=9.0), out)
    assert snapshot_tree(out) == before, "a refused float64 adapter changed the destination"

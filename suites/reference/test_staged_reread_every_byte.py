"""The staged re-read compares every byte a tensor occupies, including the bytes past its last whole 8-byte word:
a bfloat16 tensor of an odd element count ends mid-word, and a flipped bit there fails the export like any other."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from fixtures.data.adapter_states import make_native_adapter, snapshot_tree, tampering_the_staged_file

pytestmark = pytest.mark.cpu

R = 3
SHAPES = {"wq_a": (5, 7)}  # lora_A [3, 7] and lora_B [5, 3] in bf16: 42 and 30 bytes, neither a whole word count
WORD = 8


def _flip_last_byte_of_each_tensor(path) -> list[str]:
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        for entry in header.values():
            start, end = entry["data_offsets"]
            assert (end - start) % WORD, "a tensor of whole words cannot show the tail: the test proves nothing"
            f.seek(8 + n + end - 1)
            last = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([last[0] ^ 0x01]))
    return sorted(header)


def test_a_flipped_bit_in_a_tensors_last_partial_word_is_never_published(impl, tmp_path):
    def state(alpha):
        return impl.AdapterState(make_native_adapter(SHAPES, 1, R, dtype=torch.bfloat16), r=R, alpha=alpha)

    out = tmp_path / "adapter"
    impl.export_adapter(state(8.0), out)
    before = snapshot_tree(out)
    phases, calls = tampering_the_staged_file(impl.EXPORT_PHASES, tmp_path, out, _flip_last_byte_of_each_tensor)
    with pytest.raises(impl.CollectiveExportError, match="phase validate") as info:
        impl.export_adapter(state(9.0), out, phases=phases)
    flipped = [name for names in calls for name in names]
    assert flipped, "the write phase left no staged adapter file beside the destination: the test proves nothing"
    unnamed = [name for name in flipped if name not in str(info.value)]
    assert not unnamed, f"the refusal does not name {unnamed}: {info.value}"
    assert snapshot_tree(out) == before, "a corrupt staged adapter changed the destination"


#: rank 1 on a 1 x 3 projection in bf16: lora_A [1, 3] is 6 bytes and lora_B [1, 1] 2 bytes, less than one word each
TINY_R, TINY_SHAPES = 1, {"wq_a": (1, 3)}


def test_tensors_shorter_than_one_word_are_compared_byte_by_byte(impl, tmp_path):
    """A tensor of fewer bytes than one 8-byte word has no whole word at all: it still exports, and a flipped bit in
    it is still caught."""

    def state(alpha):
        tensors = make_native_adapter(TINY_SHAPES, 1, TINY_R, dtype=torch.bfloat16)
        return impl.AdapterState(tensors, r=TINY_R, alpha=alpha)

    out = tmp_path / "adapter"
    impl.export_adapter(state(8.0), out)
    assert impl.validate_adapter_dir(out)["config"]["lora_alpha"] == 8.0, "the tiny adapter was not published"
    before = snapshot_tree(out)
    phases, calls = tampering_the_staged_file(impl.EXPORT_PHASES, tmp_path, out, _flip_last_byte_of_each_tensor)
    with pytest.raises(impl.CollectiveExportError, match="phase validate") as info:
        impl.export_adapter(state(9.0), out, phases=phases)
    flipped = [name for names in calls for name in names]
    assert flipped and all(name in str(info.value) for name in flipped), f"{flipped}: {info.value}"
    assert snapshot_tree(out) == before, "a corrupt staged adapter changed the destination"

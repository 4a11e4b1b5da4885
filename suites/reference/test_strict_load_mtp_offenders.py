"""Strict load treats MTP tensors like any other once the model has MTP layers: only a model built without MTP may
declare the checkpoint's ``mtp.*`` tensors not loaded; with MTP built, an ``mtp.*`` tensor no native tensor takes
is an offender named in the error."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.data.native_weights import ensure_single_rank_megatron
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

PRESET = "tiny-mixed"
STRAY = "mtp.0.attn.wq_c.weight"  # an MTP attention weight V4 does not have


def test_a_stray_mtp_tensor_is_an_offender_when_the_model_has_mtp(impl, tmp_path):
    base = write_checkpoint(PRESET, tmp_path / "base", seed=0)
    (file,) = base.glob("*.safetensors")
    tensors = load_file(str(file))
    assert any(n.startswith("mtp.") for n in tensors), "the tiny base has no MTP tensors: the test proves nothing"
    save_file({**tensors, STRAY: torch.zeros(2, 2)}, str(file), metadata={"format": "pt"})
    ensure_single_rank_megatron(impl)
    model = impl.DeepseekV4NativeModel(impl.V4Config.from_hf(get_preset(PRESET)), include_mtp=True)
    with pytest.raises(impl.CheckpointMappingError, match=STRAY.replace(".", r"\.")):
        impl.load_official_checkpoint([model], base)

"""On a GPU, a quantized base loads into parameters on the device with the bits it gets on the CPU: the FP8 and
MXFP4 bytes move to the GPU and are dequantized there, straight into the parameters where Megatron-Bridge's
mapping only places them (``impl.landing_views``), through Bridge's own path elsewhere.

One CUDA device, one process (``scripts/device_check.sh`` runs it); skipped without CUDA, the CPU rehearsal
included. The CPU values themselves are checked against an independent dequantizer in ``test_quantized_base.py``.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.data.native_weights import ensure_single_rank_megatron
from tiny_models.quantize import quant_config, write_quantized_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantized_load_on_the_gpu_equals_the_cpu_load_bit_for_bit(impl, tmp_path, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs one CUDA device (scripts/device_check.sh)")
    ensure_single_rank_megatron(impl)
    ckpt = write_quantized_checkpoint(None, tmp_path / "ckpt", seed=5, scale_dtype="ue8m0", experts="mxfp4")
    config = impl.V4Config.from_hf(quant_config())
    on_cpu = impl.DeepseekV4NativeModel(config, include_mtp=True, params_dtype=dtype)
    on_gpu = impl.DeepseekV4NativeModel(config, include_mtp=True, params_dtype=dtype).cuda()
    impl.load_official_checkpoint([on_cpu], ckpt)
    impl.load_official_checkpoint([on_gpu], ckpt)
    gpu_params = dict(on_gpu.named_parameters())
    for name, want in on_cpu.named_parameters():
        got = gpu_params[name]
        assert got.device.type == "cuda", f"{name} left the GPU ({got.device})"
        same = torch.equal(got.detach().cpu().view(torch.uint8), want.detach().view(torch.uint8))
        assert same, f"{name} ({dtype}): loaded on the GPU it differs from the CPU load"

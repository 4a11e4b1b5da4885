"""A merged export (``export_merged_state``) of a trained LoRA model is, on every rank and at every layout, the
checkpoint's weight plus ``(alpha/r) * B @ A`` of the gathered adapter, computed in fp32 and cast once.

Shares the trained runs of ``test_adapter_roundtrip`` / ``test_lora_oracle`` (same cases, same xdist group)."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fixtures.ranks.e2e_rank_fns import run_e2e, trained_case
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-e2e")]

PRESET = "tiny-tp"
BASE_SEED = 5  # as test_adapter_roundtrip: the same cached runs


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2", "pp2"])
def test_merged_export_is_the_checkpoint_plus_the_scaled_adapter_on_every_rank(impl, tiny_ckpt_factory, layout):
    ckpt = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    case, nproc = trained_case(impl.name, ckpt, layout, seq=min_seq_len(get_preset(PRESET)))
    results = run_e2e(case, nproc=nproc)
    adapter = next(r.payload["adapter"] for r in results if "adapter" in r.payload)
    base = load_file(f"{ckpt}/model.safetensors")
    scale = adapter["alpha"] / adapter["r"]
    tensors = {n: torch.from_numpy(t) for n, t in adapter["tensors"].items()}
    checked = 0
    for r in results:
        merged = r.payload["merged"]
        assert merged, f"{layout} rank {r.rank}: no merged weights returned"
        for off, got in merged.items():
            _, layer, _, leaf, _ = off.split(".")
            stem = f"decoder.layers.{layer}.self_attention.{leaf}.adapter"
            a, b = tensors[f"{stem}.linear_in.weight"], tensors[f"{stem}.linear_out.weight"]
            want = (base[off].float() + scale * (b.float() @ a.float())).to(base[off].dtype).numpy()
            assert got.dtype == want.dtype and np.array_equal(got, want), (
                f"{layout} rank {r.rank}: merged {off} != checkpoint + (alpha/r) B@A: "
                f"max|Δ|={np.abs(got.astype(np.float64) - want.astype(np.float64)).max():.3e}"
            )
            assert not np.array_equal(got, base[off].numpy()), f"{layout}: {off} did not change (untrained adapter?)"
            checked += 1
    assert checked >= nproc * 5, f"{layout}: only {checked} merged weights checked"

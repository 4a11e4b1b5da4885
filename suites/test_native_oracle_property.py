"""For hypothesis-generated V4 configs: an official-layout checkpoint, strictly loaded into the native graph
through the bridge, reproduces transformers' logits (fp32, max |Δ| <= 1e-5)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from fixtures import asserts as ah
from fixtures.native_weights import ensure_single_rank_megatron
from fixtures.strategies import v4_configs
from tiny_models.checkpoint import load_oracle, write_checkpoint
from tiny_models.presets import min_seq_len

pytestmark = pytest.mark.cpu

TOLERANCE = 1e-5


@settings(max_examples=max(2, settings.default.max_examples // 5))
@given(spec=v4_configs())
def test_generated_configs_loaded_through_the_bridge_match_transformers(impl, spec):
    ensure_single_rank_megatron(impl)
    cfg = spec.to_config()
    with tempfile.TemporaryDirectory(prefix="dsv4-prop-") as tmp:
        ckpt = write_checkpoint(cfg, Path(tmp) / "ckpt", seed=3)

        def load_base(chunks):
            impl.load_official_checkpoint(chunks, ckpt)
            return chunks

        (model,) = impl.build_native_model(cfg, pre_wrap_hooks=[load_base])
        oracle = load_oracle(ckpt)
        ids = torch.randint(0, cfg.vocab_size, (2, min_seq_len(cfg)), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = oracle(ids).logits.float()
            got = model(ids)
    ah.assert_close(got, want, atol=TOLERANCE, name="logits", context=f"spec={spec}")

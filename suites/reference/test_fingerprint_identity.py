"""The base fingerprint identifies a base by what it is, not by how it was saved: a config re-saved in another key
order (or by another transformers version) keeps its fingerprint, a changed block scale of a quantized base does
not, and a mismatch names every tensor that differs."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.cpu

TARGETS = [f"layers.{i}.attn.{leaf}.weight" for i in range(2) for leaf in ("wq_a", "wkv")]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(8, 16, generator=g) for name in TARGETS}


def _write_base(path, tensors, config) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))


def test_a_config_re_saved_in_another_key_order_keeps_the_fingerprint(impl, tmp_path):
    """JSON objects are unordered: a re-save that writes the same keys in another order, with the saving
    library's version bumped, is the same base and must verify."""
    config = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 16, "rms_norm_eps": 1e-6, "vocab_size": 32}
    config["transformers_version"] = "5.0.0"
    _write_base(tmp_path / "saved", _state(), config)
    resaved = {k: config[k] for k in reversed(list(config))} | {"transformers_version": "5.1.0"}
    assert list(resaved) != list(config), "the re-save must change the key order, or the test proves nothing"
    _write_base(tmp_path / "resaved", _state(), resaved)
    recorded = impl.base_fingerprint(tmp_path / "saved", TARGETS)
    impl.verify_fingerprint(recorded, tmp_path / "resaved")
    assert impl.base_fingerprint(tmp_path / "resaved", TARGETS) == recorded


def test_a_changed_block_scale_of_a_quantized_base_fails_the_fingerprint(impl, tmp_path):
    """A quantized weight's value is its codes times its block scale: another scale is another base, even with
    the very same code bytes, so the fingerprint must hold the scale too."""
    codes = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).to(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 2.0)
    config = {"architectures": ["DeepseekV4ForCausalLM"]}
    name = "layers.0.attn.wq_a"
    _write_base(tmp_path / "base", {f"{name}.weight": codes, f"{name}.scale": scale}, config)
    _write_base(tmp_path / "rescaled", {f"{name}.weight": codes, f"{name}.scale": scale * 2}, config)
    recorded = impl.base_fingerprint(tmp_path / "base", [f"{name}.weight"])
    impl.verify_fingerprint(recorded, tmp_path / "base")
    with pytest.raises(impl.FingerprintMismatchError, match=rf"{name}\.scale"):
        impl.verify_fingerprint(recorded, tmp_path / "rescaled")


def test_a_fingerprint_mismatch_names_every_differing_tensor(impl):
    base = _state()
    recorded = impl.base_fingerprint(base, TARGETS)
    other = dict(base)
    changed = [TARGETS[0], TARGETS[-1]]
    for name in changed:
        other[name] = base[name] + 1.0
    with pytest.raises(impl.FingerprintMismatchError) as info:
        impl.verify_fingerprint(recorded, other)
    missing = [name for name in changed if name not in str(info.value)]
    assert not missing, f"the mismatch does not name {missing}: {info.value}"
    assert TARGETS[1] not in str(info.value), f"an unchanged tensor is named: {info.value}"

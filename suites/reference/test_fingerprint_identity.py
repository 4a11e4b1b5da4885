"""The base fingerprint identifies a base by what it is, not by how it was saved: a config re-saved in another key
order (or by another transformers version) keeps its fingerprint, a changed block scale of a quantized base does
not, and a mismatch names every tensor that differs. The record is the one docs/fingerprint.md documents, the
same from memory, from a directory or from a transformers-named state, and a sampled verify says how it compared."""

from __future__ import annotations

import hashlib
import json
import time

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


#: a weight of more than the documented 262,144 bytes, so its record carries a sample (512 KiB of float32)
LARGE = "layers.0.attn.wo_b.weight"
LARGE_SHAPE = (256, 512)
#: a weight of exactly 262,144 bytes: not more, so no sample
AT_LIMIT = "layers.1.attn.wo_b.weight"
SAMPLE_TAG, SAMPLE_PAGES, SAMPLE_PAGE = b"dsv4-lora sample v1", 64, 4096


def _documented_record(t: torch.Tensor) -> dict:
    """A tensor's record as docs/fingerprint.md writes it, computed here without impl."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    record = {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    if len(raw) > SAMPLE_PAGES * SAMPLE_PAGE:
        h = hashlib.sha256(SAMPLE_TAG + len(raw).to_bytes(8, "little"))
        for i in range(SAMPLE_PAGES):
            start = i * (len(raw) - SAMPLE_PAGE) // (SAMPLE_PAGES - 1)
            h.update(raw[start : start + SAMPLE_PAGE])
        record["sample_sha256"] = h.hexdigest()
    return record


def _large_base(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return _state(seed) | {LARGE: torch.randn(*LARGE_SHAPE, generator=g), AT_LIMIT: torch.randn(256, 256, generator=g)}


def test_a_fingerprint_is_recorded_in_the_documented_format(impl, tmp_path, monkeypatch):
    """docs/fingerprint.md is the format another tool produces or checks: version 1, the config's canonical JSON
    hashed without the re-save keys, and per tensor its shape, dtype, sha256 and (above 262,144 bytes) the sample
    of 64 pages. The same record comes from the state in memory and from the checkpoint directory."""
    monkeypatch.setenv("DSV4_LORA_CACHE", "off")
    state = _large_base()
    config = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 16, "transformers_version": "5.0.0"}
    _write_base(tmp_path / "base", state, config)
    canonical = json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 16}, sort_keys=True)
    names = [*TARGETS, LARGE, AT_LIMIT]
    assert state[AT_LIMIT].numel() * 4 == SAMPLE_PAGES * SAMPLE_PAGE, "the at-limit weight must be 262,144 bytes"
    expected = {
        "version": 1,
        "config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
        "tensors": {n: _documented_record(state[n]) for n in names},
    }
    for source, fingerprint in (
        ("the checkpoint directory", impl.base_fingerprint(tmp_path / "base", names)),
        ("the state in memory", impl.base_fingerprint(state, names, config=config)),
    ):
        for field in ("version", "config_sha256"):
            assert fingerprint[field] == expected[field], (
                f"{source}: {field} {fingerprint[field]!r} is not as documented"
            )
        for name in names:
            got, want = fingerprint["tensors"].get(name), expected["tensors"][name]
            assert got == want, f"{source}: {name}'s record {got} is not the documented {want}"


#: the released V4 quantization_config's other keys, on both sides of "expert_dtype" in sort order
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "resaved",
    [
        {"quantization_config": {"expert_dtype": "fp4", **QUANT}},
        {"expert_dtype": "fp4", "quantization_config": {"expert_dtype": "fp4", **QUANT}},
    ],
    ids=["moved-into-quantization_config", "in-both-places"],
)
def test_expert_dtype_moved_into_quantization_config_keeps_the_fingerprint(impl, tmp_path, resaved):
    """transformers >= 5.23 re-saves the released config with ``expert_dtype`` moved from the top into
    ``quantization_config``: the same base, so an adapter recorded on the released config verifies."""
    released = {"architectures": ["DeepseekV4ForCausalLM"], "expert_dtype": "fp4", "quantization_config": QUANT}
    _write_base(tmp_path / "released", _state(), released)
    _write_base(tmp_path / "resaved", _state(), {"architectures": ["DeepseekV4ForCausalLM"]} | resaved)
    recorded = impl.base_fingerprint(tmp_path / "released", TARGETS)
    impl.verify_fingerprint(recorded, tmp_path / "resaved")


def test_a_quantization_config_holding_only_expert_dtype_is_the_config_without_it(impl, tmp_path):
    """A config whose quantization_config held nothing but the moved ``expert_dtype`` is the released config
    that had no quantization_config at all."""
    _write_base(tmp_path / "released", _state(), {"expert_dtype": "fp4"})
    _write_base(tmp_path / "resaved", _state(), {"quantization_config": {"expert_dtype": "fp4"}})
    impl.verify_fingerprint(impl.base_fingerprint(tmp_path / "released", TARGETS), tmp_path / "resaved")


@pytest.mark.parametrize(("top", "inside"), [("fp8", "fp4"), ("fp4", "fp8")])
def test_a_config_naming_two_expert_dtypes_is_another_base(impl, tmp_path, top, inside):
    """``expert_dtype`` at the top and a different one in ``quantization_config`` is neither base that names one
    of them: the fingerprint refuses both, naming config.json."""
    quant = QUANT
    _write_base(
        tmp_path / "both", _state(), {"expert_dtype": top, "quantization_config": quant | {"expert_dtype": inside}}
    )
    recorded = impl.base_fingerprint(tmp_path / "both", TARGETS)
    for dtype in (top, inside):
        _write_base(tmp_path / dtype, _state(), {"expert_dtype": dtype, "quantization_config": quant})
        with pytest.raises(impl.FingerprintMismatchError, match=r"config\.json"):
            impl.verify_fingerprint(recorded, tmp_path / dtype)


def test_a_different_config_is_refused_whichever_base_was_recorded(impl, tmp_path):
    """Two bases with the same tensors and different configs: an adapter recorded on either is refused on the
    other, naming config.json (whichever way the digests happen to compare)."""
    for name, eps in (("a", 1e-6), ("b", 1e-5)):
        _write_base(tmp_path / name, _state(), {"architectures": ["DeepseekV4ForCausalLM"], "rms_norm_eps": eps})
    for recorded_on, other in (("a", "b"), ("b", "a")):
        recorded = impl.base_fingerprint(tmp_path / recorded_on, TARGETS)
        with pytest.raises(impl.FingerprintMismatchError, match=r"config\.json"):
            impl.verify_fingerprint(recorded, tmp_path / other)


def _flip_byte(shard, name: str, at: int) -> None:
    """Flip one bit of byte ``at`` of tensor ``name`` in place (its offset read from the safetensors header)."""
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + json.loads(raw[8 : 8 + n])[name]["data_offsets"][0] + at] ^= 0x40
    shard.write_bytes(bytes(raw))


def test_a_sampled_verify_compares_large_weights_by_their_sample_and_says_how_many(impl, tmp_path, monkeypatch):
    """``sampled=True`` compares a large weight whose digest is not remembered by its recorded sample, every small
    one by its bytes, and says how many went each way; a byte changed inside a sampled page is still a mismatch,
    one between the pages only the full comparison sees."""
    monkeypatch.setenv("DSV4_LORA_CACHE", "off")
    _write_base(tmp_path / "base", _large_base(), {"architectures": ["DeepseekV4ForCausalLM"]})
    names = [*TARGETS, LARGE, AT_LIMIT]
    recorded = impl.base_fingerprint(tmp_path / "base", names)
    full = impl.verify_fingerprint(recorded, tmp_path / "base")
    assert tuple(full) == (len(names), 0), f"a full verify compared {full}, not every tensor by its bytes"
    sampled = impl.verify_fingerprint(recorded, tmp_path / "base", sampled=True)
    assert tuple(sampled) == (len(names) - 1, 1), f"a sampled verify compared {sampled}, not only {LARGE} by its sample"
    _flip_byte(
        tmp_path / "base" / "model.safetensors", LARGE, at=6000
    )  # between the first two sampled pages (0 and 8256)
    impl.verify_fingerprint(recorded, tmp_path / "base", sampled=True)
    with pytest.raises(impl.FingerprintMismatchError, match=LARGE.replace(".", r"\.")):
        impl.verify_fingerprint(recorded, tmp_path / "base")
    _flip_byte(tmp_path / "base" / "model.safetensors", LARGE, at=0)  # the first sampled page
    with pytest.raises(impl.FingerprintMismatchError, match=LARGE.replace(".", r"\.")):
        impl.verify_fingerprint(recorded, tmp_path / "base", sampled=True)


def test_an_index_naming_a_tensor_its_shard_lacks_is_a_mismatch_naming_both(impl, tmp_path):
    """A checkpoint whose index sends a targeted tensor to a shard without it is not the recorded base: the
    refusal names the shard and the tensor, never a crash."""
    _write_base(tmp_path / "base", {n: t for n, t in _state().items() if n != TARGETS[1]}, {})
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in TARGETS}}
    (tmp_path / "base" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(impl.FingerprintMismatchError, match=rf"model\.safetensors: has no tensor {TARGETS[1]}"):
        impl.base_fingerprint(tmp_path / "base", TARGETS)


#: the transformers names of TARGETS (written here by hand: an independent statement of the naming)
TRANSFORMERS_NAMES = {
    f"layers.{i}.attn.{leaf}.weight": f"model.layers.{i}.self_attn.{proj}.weight"
    for i in range(2)
    for leaf, proj in (("wq_a", "q_a_proj"), ("wkv", "kv_proj"))
}


def test_a_state_in_transformers_names_has_the_fingerprint_of_the_same_base_in_official_names(impl):
    """A base loaded by transformers is fingerprinted by the official names, with the same records as the
    official state; an official name the transformers state has no tensor for (the MTP layer's) is refused,
    never taken from a decoder layer."""
    official = _state()
    transformers = {TRANSFORMERS_NAMES[n]: t for n, t in official.items()}
    assert impl.base_fingerprint(transformers, TARGETS) == impl.base_fingerprint(official, TARGETS), (
        "the transformers-named state's fingerprint differs from the official one's"
    )
    with pytest.raises(impl.FingerprintMismatchError, match=r"mtp\.0\.attn\.wq_a\.weight"):
        impl.base_fingerprint(transformers, ["mtp.0.attn.wq_a.weight"])
    del transformers[TRANSFORMERS_NAMES[TARGETS[-1]]]
    with pytest.raises(impl.FingerprintMismatchError, match=TARGETS[-1].replace(".", r"\.")):
        impl.base_fingerprint(transformers, TARGETS)


def test_a_base_without_a_recorded_scale_is_named_with_every_other_difference(impl, tmp_path):
    """An adapter recorded on a quantized base, checked against a base where one weight lost its block scale and
    a later weight changed: the refusal names the absent scale and the changed weight, not only the first."""
    g = torch.Generator().manual_seed(4)
    codes = {n: torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn) for n in TARGETS}
    scales = {n.removesuffix(".weight") + ".scale": torch.full((1, 1), 2.0) for n in TARGETS}
    _write_base(tmp_path / "base", codes | scales, {})
    recorded = impl.base_fingerprint(tmp_path / "base", TARGETS)
    first_scale, last = TARGETS[0].removesuffix(".weight") + ".scale", TARGETS[-1]
    other = {n: t for n, t in (codes | scales).items() if n != first_scale}
    other[last] = torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn)
    _write_base(tmp_path / "other", other, {})
    with pytest.raises(impl.FingerprintMismatchError) as info:
        impl.verify_fingerprint(recorded, tmp_path / "other")
    unnamed = [n for n in (first_scale, last) if n not in str(info.value)]
    assert not unnamed, f"the refusal does not name {unnamed}: {info.value}"


def test_a_config_passed_for_a_checkpoint_directory_is_the_one_hashed(impl, tmp_path):
    """``config=`` is the base's config even where the directory holds a config.json (the one a caller loaded and
    maybe adjusted); without either, the fingerprint records no config and checks none."""
    given = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 16}
    _write_base(tmp_path / "base", _state(), given | {"hidden_size": 32})
    from_dir = impl.base_fingerprint(tmp_path / "base", TARGETS, config=given)
    assert from_dir == impl.base_fingerprint(_state(), TARGETS, config=given), "config= was not the config hashed"
    (tmp_path / "base" / "config.json").unlink()
    bare = impl.base_fingerprint(tmp_path / "base", TARGETS)
    assert bare["config_sha256"] is None, f"a base without config.json recorded config {bare['config_sha256']}"
    impl.verify_fingerprint(from_dir, tmp_path / "base")


def test_a_sampled_verify_compares_a_remembered_digest_by_every_byte(impl, tmp_path, monkeypatch):
    """Where a large weight's full digest is remembered for its unchanged shard, even a sampled verify compares it
    by every byte (docs/fingerprint.md): the sample is only for a base's first check."""
    monkeypatch.setenv("DSV4_LORA_CACHE", str(tmp_path / "cache"))
    _write_base(tmp_path / "base", _large_base(), {"architectures": ["DeepseekV4ForCausalLM"]})
    time.sleep(1.1)  # settled: older than the cache's racy margin, so its digests are remembered
    names = [*TARGETS, LARGE]
    recorded = impl.base_fingerprint(tmp_path / "base", names)
    check = impl.verify_fingerprint(recorded, tmp_path / "base", sampled=True)
    assert tuple(check) == (len(names), 0), f"with {LARGE}'s digest remembered, a sampled verify compared {check}"

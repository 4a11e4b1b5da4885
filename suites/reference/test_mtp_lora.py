"""LoRA on a model built with its MTP layer (``include_mtp=True``, as the Flash recipe builds it).

Decided behaviour (``impl.MTP_POLICIES``): by default (``mtp='exclude'``) the LoRA targets never reach the MTP layer,
so training through the main loss updates every adapter and every dialect exports the adapter. With
``mtp='include'`` the MTP attention is wrapped; the main loss never reaches it (its adapters do not move), the
official dialect carries it as ``mtp.0.attn.*``, transformers and SGLang refuse it unless the export drops it
(``export_adapter(mtp='exclude')``, recorded in the adapter metadata).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import safe_open

from fixtures.runner.multirank import impl_preload, run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

PRESET = "tiny-mixed"
TARGETS = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b"]
DIALECTS = ("transformers", "official", "sglang")
TIMEOUT_S = 300


@dataclass(frozen=True)
class MtpCase:
    impl_name: str
    out: str
    mtp: str  # the LoRA policy under test
    steps: int = 2


def rank_mtp_lora_train_export(rank: int, world_size: int, case: MtpCase) -> dict:
    """Build with MTP, LoRA (policy ``case.mtp``) before DDP, train, gather, export in every dialect."""
    import torch

    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import init_megatron_parallel
    from tiny_models.presets import get_preset, min_seq_len

    api = load_impl(case.impl_name)
    init_megatron_parallel()
    cfg = get_preset(PRESET)
    hook = api.make_lora_pre_wrap_hook(targets=TARGETS, rank=4, alpha=8.0, mtp=case.mtp)
    (chunk,) = api.build_native_model(cfg, include_mtp=True, pre_wrap_hooks=[hook], wrap_with_ddp=True)
    model = chunk.module
    mtp_modules = [n for n, _ in model.named_modules() if n.startswith("mtp.")]
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # lora_B starts at zero, so lora_A only moves from the second step on: compare after all steps
    before = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.Adam(adapters.values(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(case.steps):
        ids = torch.randint(0, cfg.vocab_size, (2, min_seq_len(cfg)), generator=gen).to(api.rank_device())
        opt.zero_grad(set_to_none=True)
        chunk.zero_grad_buffer()
        api.ManualPipeline(chunk).run(ids, labels=torch.roll(ids, -1, dims=1), backward=True)
        chunk.finish_grad_sync()
        for p in adapters.values():
            p.grad = p.main_grad.to(p.dtype)
        opt.step()
    unchanged = sorted(n for n, p in adapters.items() if torch.equal(p.detach(), before[n]))
    state = api.gather_adapter_state([chunk], hook.handle)
    exports: dict[str, str] = {}
    for dialect in DIALECTS:
        for export_mtp in ("reject", "exclude"):
            out = Path(case.out) / f"{dialect}-{export_mtp}"
            try:
                api.export_adapter(state, out, dialect=dialect, mtp=export_mtp, timeout_s=60)
                exports[f"{dialect}/{export_mtp}"] = "ok"
            except api.ExportError as exc:
                exports[f"{dialect}/{export_mtp}"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
    return {
        "has_mtp": bool(mtp_modules),
        "wrapped": [n for names in hook.handle.wrapped for n in names],
        "trainable": sorted(adapters),
        "unchanged": unchanged,
        "exports": exports,
    }


def _adapter_names(directory: Path) -> list[str]:
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as fh:
        return list(fh.keys())


def _run(impl, tmp_path, mtp: str) -> dict:
    case = MtpCase(impl.name, str(tmp_path), mtp)
    (result,) = run_ranks(
        rank_mtp_lora_train_export, case, nproc=1, timeout_s=TIMEOUT_S, preload=impl_preload(impl.name)
    )
    assert result.payload["has_mtp"], "the model was built without its MTP layer; the case tests nothing"
    return result.payload


def test_default_lora_leaves_mtp_alone_and_every_dialect_exports_the_trained_adapter(impl, tmp_path):
    p = _run(impl, tmp_path, "exclude")
    in_mtp = [n for n in p["wrapped"] + p["trainable"] if n.startswith("mtp.")]
    assert not in_mtp, f"mtp='exclude' (the default) still wrapped or trains MTP modules: {in_mtp}"
    assert p["wrapped"], "no module was wrapped"
    assert not p["unchanged"], f"adapters not updated by training: {p['unchanged']}"
    for key, outcome in p["exports"].items():
        assert outcome == "ok", f"export {key} failed with the default MTP policy: {outcome}"
    for dialect in DIALECTS:
        names = _adapter_names(tmp_path / f"{dialect}-reject")
        assert names and not [n for n in names if "mtp" in n], f"{dialect}: MTP tensors in {names[:8]}"


def test_included_mtp_lora_is_untrained_by_the_main_loss_and_only_official_carries_it(impl, tmp_path):
    p = _run(impl, tmp_path, "include")
    mtp_wrapped = [n for n in p["wrapped"] if n.startswith("mtp.")]
    assert len(mtp_wrapped) == len(TARGETS), f"mtp='include' wrapped {mtp_wrapped}, expected the 5 MTP projections"
    # the manual pipeline trains the main loss only: the MTP adapters never move (why exclude is the default)
    mtp_unchanged = [n for n in p["unchanged"] if n.startswith("mtp.")]
    assert mtp_unchanged and all(n.startswith("mtp.") for n in p["unchanged"]), p["unchanged"]
    assert p["exports"]["official/reject"] == "ok", p["exports"]
    official = _adapter_names(tmp_path / "official-reject")
    assert any(".mtp.0.attn." in n for n in official), f"official export lacks mtp.0.attn.*: {official[-6:]}"
    for dialect in ("transformers", "sglang"):
        refused = p["exports"][f"{dialect}/reject"]
        assert "MtpNotExportableError" in refused and "mtp='exclude'" in refused, f"{dialect}: {refused}"
        assert p["exports"][f"{dialect}/exclude"] == "ok", p["exports"]
        meta = json.loads((tmp_path / f"{dialect}-exclude" / "adapter_config.json").read_text())
        names = _adapter_names(tmp_path / f"{dialect}-exclude")
        assert not [n for n in names if "mtp" in n], f"{dialect} with mtp='exclude' still holds MTP tensors"
        assert meta, f"{dialect}: empty adapter_config.json"


def test_unknown_mtp_policy_is_a_target_error(impl):
    with pytest.raises(impl.TargetError, match="mtp="):
        impl.make_lora_pre_wrap_hook(targets=TARGETS, rank=4, alpha=8.0, mtp="train")


@pytest.fixture
def single_rank(impl):
    """Megatron-Bridge 0.4's LoRA asks parallel state for the TP size, even of a model built without it."""
    from fixtures.data.native_weights import ensure_single_rank_megatron

    ensure_single_rank_megatron(impl)


@pytest.mark.parametrize("exclude", [None, ["*.layers.3.*"]], ids=["mtp-only", "mtp-and-an-exclusion"])
def test_last_stage_with_mtp_wraps_its_own_global_layers(impl, single_rank, exclude):
    """A last pipeline stage holds global layers 2-3 and the MTP layer: excluding MTP (or anything) must still wrap
    exactly the selected layers, although Megatron-Bridge's walk names them by position (layers.0, layers.1)."""
    from tiny_models.presets import get_preset

    cfg = impl.V4Config.from_hf(get_preset(PRESET))
    model = impl.DeepseekV4NativeModel(cfg, layer_numbers=[2, 3], include_mtp=True)
    handle = impl.apply_lora(model, targets=["wq_a", "wo_b"], exclude=exclude, rank=2, alpha=4.0)
    layers = [2] if exclude else [2, 3]
    want = [f"decoder.layers.{n}.self_attention.{t}" for n in layers for t in ("wq_a", "wo_b")]
    assert sorted(handle.wrapped[0]) == sorted(want), f"wrapped {handle.wrapped[0]}, expected {want}"


def test_the_include_policy_wraps_the_mtp_attention_as_well(impl, single_rank):
    """``mtp='include'`` wraps the targets in the MTP layer's attention too; the default leaves the MTP layer alone."""
    from tiny_models.presets import get_preset

    cfg = impl.V4Config.from_hf(get_preset(PRESET))
    wrapped = {}
    for policy in ("include", "exclude"):
        model = impl.DeepseekV4NativeModel(cfg, layer_numbers=[2, 3], include_mtp=True)
        handle = impl.apply_lora(model, targets=["wq_a", "wo_b"], rank=2, alpha=4.0, mtp=policy)
        wrapped[policy] = sorted(n for n in handle.wrapped[0] if n.startswith("mtp."))
    mtp_attention = "mtp.layers.0.mtp_model_layer.self_attention"
    assert wrapped["include"] == [f"{mtp_attention}.wo_b", f"{mtp_attention}.wq_a"], wrapped["include"]
    assert wrapped["exclude"] == [], f"mtp='exclude' wrapped MTP modules: {wrapped['exclude']}"


@dataclass(frozen=True)
class StageCase:
    impl_name: str
    #: a target held by stage 0 only (global layer 0) and an exclusion of a module stage 1 holds only (layer 3)
    targets: tuple[str, ...] = ("decoder.layers.0.self_attention.wq_a",)
    exclude: tuple[str, ...] = ("decoder.layers.3.*",)


def rank_lora_on_one_stage(rank: int, world_size: int, case: StageCase) -> dict:
    """PP=2 over tiny-mixed's four layers: stage r builds global layers 2r, 2r+1 and applies LoRA."""
    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import destroy_megatron_parallel, init_megatron_parallel
    from tiny_models.presets import get_preset

    impl = load_impl(case.impl_name)
    init_megatron_parallel(pp=2)
    try:
        cfg = impl.V4Config.from_hf(get_preset(PRESET))
        model = impl.DeepseekV4NativeModel(cfg, layer_numbers=[2 * rank, 2 * rank + 1])
        handle = impl.apply_lora(model, targets=list(case.targets), exclude=list(case.exclude), rank=2, alpha=4.0)
        return {"wrapped": sorted(handle.wrapped[0])}
    finally:
        destroy_megatron_parallel()


def test_a_target_or_exclusion_on_one_pipeline_stage_only_is_accepted_on_every_stage(impl):
    """A target (or exclusion) may name a module only one pipeline stage holds: every stage accepts it (the
    stages agree on what matched somewhere) and wraps exactly its own share; none refuses it as matching nothing."""
    results = run_ranks(
        rank_lora_on_one_stage, StageCase(impl.name), nproc=2, timeout_s=120, preload=impl_preload(impl.name)
    )
    wrapped = {r.rank: r.payload["wrapped"] for r in results}
    want = {0: ["decoder.layers.0.self_attention.wq_a"], 1: []}
    assert wrapped == want, f"PP=2, target on stage 0 only: stage -> wrapped {wrapped}, expected {want}"


def test_the_mtp_policies_are_read_only(impl):
    """``MTP_POLICIES`` is shared by every call: a caller cannot flip what 'exclude' means for the next one."""
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        impl.MTP_POLICIES["exclude"].wraps_mtp = True
    assert impl.MTP_POLICIES["exclude"].wraps_mtp is False, "MTP_POLICIES['exclude'].wraps_mtp changed"

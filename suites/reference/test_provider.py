"""The native provider: V4 only, layouts checked before construction, PEFT hooks before DDP."""

from __future__ import annotations

import pytest

from fixtures.ranks.provider_rank_fns import ProviderCase, rank_provider_hook_before_ddp
from fixtures.runner.multirank import impl_preload, run_ranks
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu


def test_ddp_is_built_after_the_pre_wrap_hook(impl):
    """DDP's gradient buffers hold exactly the parameters the hook left trainable."""
    case = ProviderCase(
        impl_name=impl.name, preset="tiny-mixed", trainable_prefix="decoder.layers.0.self_attention.wq_b"
    )
    preload = impl_preload(impl.name)
    (result,) = [
        r.payload for r in run_ranks(rank_provider_hook_before_ddp, case, nproc=1, timeout_s=240, preload=preload)
    ]
    assert result["hook_saw"] == ["DeepseekV4NativeModel"], "the hook must see bare, unwrapped chunks"
    assert result["wrapped_types"] == ["DistributedDataParallel"]
    assert result["trainable"] == ["decoder.layers.0.self_attention.wq_b.weight"]
    assert result["ddp_buffer_params"] == result["trainable"], (
        f"DDP buffers {result['ddp_buffer_params']} != trainable after hook {result['trainable']}"
    )


def test_multi_lora_is_rejected_before_anything_is_built(impl):
    with pytest.raises(impl.MultiLoRAUnsupportedError, match="Multi-LoRA"):
        impl.build_native_model(get_preset("tiny-mixed"), multi_lora=True)


def test_non_v4_config_is_never_routed_to_the_native_provider(impl):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(impl.NotDeepseekV4Error, match="DeepseekV3ForCausalLM"):
        impl.build_native_model(cfg)


@pytest.mark.parametrize(
    ("tp", "ep", "match"),
    [(3, 1, "tensor_model_parallel_size=3"), (1, 3, "expert")],
    ids=["heads-not-divisible-by-tp", "experts-not-divisible-by-ep"],
)
def test_unsupported_parallel_layouts_are_rejected_before_construction(impl, tp, ep, match):
    with pytest.raises(impl.UnsupportedConfigError, match=match):
        impl.build_native_model(get_preset("tiny-tp"), tp=tp, ep=ep)


def test_uninitialized_parallel_state_is_a_clear_error(impl, monkeypatch):
    from megatron.core import parallel_state

    # Another test in this worker may have initialised it; simulate a fresh process.
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(impl.UnsupportedConfigError, match="initialize_model_parallel"):
        impl.build_native_model(get_preset("tiny-mixed"))


@pytest.mark.multirank
def test_virtual_pipeline_chunks_follow_the_interleaved_layout(impl):
    """pp=2 x vpp=2 over tiny-tp's 4 layers: rank r's chunk v is virtual stage v*pp + r; embedding first, loss last."""
    from fixtures.ranks.provider_rank_fns import VppCase, rank_provider_virtual_pipeline

    results = run_ranks(
        rank_provider_virtual_pipeline,
        VppCase(impl.name, "tiny-tp", pp=2, vpp=2),
        nproc=2,
        timeout_s=240,
        preload=impl_preload(impl.name),
    )
    layout = impl.generate_pipeline_layout(
        4, 4, num_hash_layers=get_preset("tiny-tp").mlp_layer_types.count("hash_moe")
    )
    for r in results:
        chunks = r.payload["chunks"]
        assert len(chunks) == 2, f"rank {r.rank}: {len(chunks)} chunks, expected one per virtual stage"
        for v, chunk in enumerate(chunks):
            stage = v * 2 + r.rank
            assert chunk["layers"] == list(impl.stage_layer_numbers(layout, stage)), (
                f"rank {r.rank} virtual stage {v}: layers {chunk['layers']}"
            )
            assert chunk["pre_process"] == (stage == 0) and chunk["post_process"] == (stage == 3), (
                f"rank {r.rank} virtual stage {v}: pre/post {chunk['pre_process']}/{chunk['post_process']}"
            )

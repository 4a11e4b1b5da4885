"""Device placement: a rank's model, DDP buffers, optimizer state and inputs live on the rank's device.

On this CPU host everything must be on the CPU, and the audit must name anything that is not. What a CUDA host
would get is shown by patching ``torch.cuda.is_available``: the model's Megatron config must ask for GPU
initialization and Megatron-Bridge's ``get_model`` must move every chunk to the current device (``Module.cuda`` is
recorded, nothing is allocated on a GPU). Cross-stage control messages must not be CPU tensors handed to tensor
collectives (NCCL refuses them): the LoRA target check over a pipeline is run on 2 ranks with tensor collectives
recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fixtures.runner.multirank import impl_preload, run_ranks

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

PRESET = "tiny-tp"
TARGETS = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b"]
TIMEOUT_S = 300


@dataclass(frozen=True)
class PlacementCase:
    impl_name: str
    preset: str = PRESET
    pp: int = 1


def rank_cpu_build_audit(rank: int, world_size: int, case: PlacementCase) -> dict:
    """Provider build with LoRA before DDP, one Adam step, then the audit against the CPU and against 'meta'."""
    import torch

    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import init_megatron_parallel
    from tiny_models.presets import get_preset, min_seq_len

    api = load_impl(case.impl_name)
    init_megatron_parallel()
    cfg = get_preset(case.preset)
    hook = api.make_lora_pre_wrap_hook(targets=TARGETS, rank=4, alpha=8.0)
    chunks = api.build_native_model(cfg, pre_wrap_hooks=[hook], wrap_with_ddp=True)
    (chunk,) = chunks
    adapters = [p for p in chunk.module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(adapters, lr=1e-3)
    device = api.rank_device()
    ids = torch.randint(0, cfg.vocab_size, (1, min_seq_len(cfg)), device=device)
    chunk.zero_grad_buffer()
    chunk(ids, labels=torch.roll(ids, -1, dims=1)).mean().backward()
    chunk.finish_grad_sync()
    for p in adapters:
        p.grad = p.main_grad.to(p.dtype)
    opt.step()
    misplaced = [str(m) for m in api.audit_devices(chunks, opt, expected=device, inputs={"input_ids": ids})]
    elsewhere = api.audit_devices(chunks, opt, expected="meta", inputs={"input_ids": ids})
    # one tensor moved off the rank's device must be named by the audit and by the raising form
    buffer_name, buffer = next(iter(chunk.module.named_buffers()))
    stray = torch.empty_like(buffer, device="meta")
    owner, _, leaf = buffer_name.rpartition(".")
    chunk.module.get_submodule(owner).register_buffer(leaf, stray)
    after_move = [str(m) for m in api.audit_devices(chunks, opt, expected=device)]
    try:
        api.require_devices(chunks, opt, expected=device)
        raised = ""
    except api.DevicePlacementError as exc:
        raised = str(exc)
    return {
        "device": str(device),
        "misplaced": misplaced,
        "kinds_elsewhere": sorted({m.kind for m in elsewhere}),
        "count_elsewhere": len(elsewhere),
        "n_params": sum(1 for _ in chunk.module.parameters()),
        "moved": buffer_name,
        "after_move": after_move,
        "raised": raised,
    }


def rank_cuda_host_build(rank: int, world_size: int, case: PlacementCase) -> dict:
    """Build through the provider with ``torch.cuda.is_available`` patched True and ``Module.cuda`` recorded."""
    import torch

    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import init_megatron_parallel
    from tiny_models.presets import get_preset

    api = load_impl(case.impl_name)
    init_megatron_parallel()
    moved: list[str] = []

    def record_cuda(self, device=None):
        moved.append(type(self).__name__)
        return self

    real_available, real_cuda = torch.cuda.is_available, torch.nn.Module.cuda
    torch.cuda.is_available, torch.nn.Module.cuda = (lambda: True), record_cuda
    try:
        chunks = api.build_native_model(get_preset(case.preset))
    finally:
        torch.cuda.is_available, torch.nn.Module.cuda = real_available, real_cuda
    return {
        "chunk_types": [type(c).__name__ for c in chunks],
        "use_cpu_initialization": [c.config.use_cpu_initialization for c in chunks],
        "moved_by_get_model": moved,
    }


def rank_pipeline_lora_collectives(rank: int, world_size: int, case: PlacementCase) -> dict:
    """LoRA on a PP=2 model with ``torch.distributed``'s tensor collectives recorded (object collectives pass)."""
    import torch.distributed as dist

    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import init_megatron_parallel
    from tiny_models.presets import get_preset

    api = load_impl(case.impl_name)
    init_megatron_parallel(pp=case.pp)
    chunks = api.build_native_model(get_preset(case.preset), pp=case.pp)
    calls: list[str] = []
    names = ("all_reduce", "all_gather", "broadcast", "send", "recv", "reduce_scatter", "all_to_all")
    real = {n: getattr(dist, n) for n in names}

    def recorder(name):
        def call(tensor_or_list, *args, **kwargs):
            tensors = tensor_or_list if isinstance(tensor_or_list, list) else [tensor_or_list]
            calls.append(f"{name}({', '.join(f'{t.dtype} on {t.device}' for t in tensors)})")
            return real[name](tensor_or_list, *args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, recorder(n))
    try:
        handle = api.apply_lora(chunks, targets=TARGETS, rank=4, alpha=8.0)
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    return {"tensor_collectives": calls, "wrapped": sum(len(w) for w in handle.wrapped)}


def _on_one_rank(rank_fn, impl) -> dict:
    """``rank_fn``'s payload from one (warm) rank building the default case."""
    (result,) = run_ranks(
        rank_fn, PlacementCase(impl.name), nproc=1, timeout_s=TIMEOUT_S, preload=impl_preload(impl.name)
    )
    return result.payload


def test_provider_build_keeps_every_tensor_on_the_rank_device_and_the_audit_names_strays(impl):
    """On this CPU host the rank's device is the CPU; on a CUDA host (scripts/device_check.sh) it is cuda:0."""
    import torch

    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    result = _on_one_rank(rank_cpu_build_audit, impl)
    assert result["device"] == want, f"impl.rank_device() is {result['device']}, expected {want}"
    assert result["misplaced"] == [], f"tensors off {want} after a provider build:\n  " + "\n  ".join(
        result["misplaced"][:40]
    )
    # against another device the audit must see every kind of tensor it promises to walk
    want_kinds = ["buffer", "ddp grad_data", "input", "main_grad", "optimizer state", "parameter"]
    missing = [k for k in want_kinds if k not in result["kinds_elsewhere"]]
    assert not missing, f"the audit never looked at {missing} (saw {result['kinds_elsewhere']})"
    assert result["count_elsewhere"] >= result["n_params"], result
    assert len(result["after_move"]) == 1 and result["moved"] in result["after_move"][0], (
        f"moved buffer {result['moved']} to 'meta'; the audit reported {result['after_move']}"
    )
    assert result["moved"] in result["raised"], f"require_devices did not name {result['moved']}: {result['raised']!r}"


def test_a_cuda_host_gets_a_gpu_placed_model_from_the_provider(impl):
    result = _on_one_rank(rank_cuda_host_build, impl)
    assert result["use_cpu_initialization"] == [False] * len(result["chunk_types"]), (
        f"with CUDA available the model config still asks for CPU initialization: {result}; Megatron-Bridge's "
        "get_model then never moves the model to the GPU"
    )
    assert result["chunk_types"] and all(t in result["moved_by_get_model"] for t in result["chunk_types"]), (
        f"get_model did not call .cuda() on the chunks {result['chunk_types']} (recorded {result['moved_by_get_model']})"
    )


def test_lora_target_check_across_pipeline_stages_sends_no_cpu_tensor_to_a_tensor_collective(impl):
    """Under NCCL a CPU tensor in all_reduce fails: the check's flags must travel as objects (backend's device)."""
    results = run_ranks(
        rank_pipeline_lora_collectives, PlacementCase(impl.name, pp=2), nproc=2, timeout_s=TIMEOUT_S,
        preload=impl_preload(impl.name),
    )  # fmt: skip
    for r in results:
        assert r.payload["wrapped"] > 0, f"rank {r.rank}: LoRA wrapped nothing"
        assert r.payload["tensor_collectives"] == [], (
            f"rank {r.rank}: LoRA application handed tensors to tensor collectives {r.payload['tensor_collectives']}"
        )

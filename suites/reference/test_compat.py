"""The CPU compatibility layer: active exactly where the real thing is missing, and loud when misused."""

from __future__ import annotations

import importlib.machinery
import textwrap

import pytest
import torch

from fixtures.runner.subproc import REPO_ROOT, run_python

pytestmark = pytest.mark.cpu

# Loads one compat module by path, bypassing impl/__init__ (which would install everything).
_LOAD = textwrap.dedent(
    """
    import importlib.util, sys
    def load(name):
        spec = importlib.util.spec_from_file_location(name, r"{root}/impl/compat/" + name + ".py")
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod
    """
).format(root=REPO_ROOT)


def _real_transformer_engine_on_path() -> bool:
    """Whether a real ``transformer_engine`` is importable, asked of the path finder alone: the stub is a
    ``sys.meta_path`` finder, so this answer does not depend on whether it is installed."""
    return importlib.machinery.PathFinder.find_spec("transformer_engine") is not None


def test_stub_is_active_exactly_when_real_transformer_engine_is_missing(impl):
    te_missing = not _real_transformer_engine_on_path()
    assert impl.compat_report().te_stub is te_missing, (
        f"te_stub={impl.compat_report().te_stub}, TE missing={te_missing}"
    )
    import transformer_engine

    assert getattr(transformer_engine, "__te_stub__", False) is te_missing, transformer_engine


def test_stubbed_transformer_engine_class_raises_clear_error(impl):
    if _real_transformer_engine_on_path():
        pytest.skip("a real transformer_engine is installed here, so the stub is (rightly) not active")
    impl.compat_report()
    import transformer_engine.pytorch as te

    with pytest.raises(impl.TransformerEngineStubError, match=r"transformer_engine\.pytorch\.Linear.*import stub"):
        te.Linear(4, 4)
    with pytest.raises(impl.TransformerEngineStubError, match="local"):
        te.ops.Sequential()


def test_stub_is_not_installed_when_real_transformer_engine_exists(tmp_path):
    """Simulated availability: a real (non-stub) transformer_engine on sys.path wins."""
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '2.20.2'\nREAL = True\n")
    out = run_python(
        _LOAD
        + textwrap.dedent(
            f"""
            sys.path.insert(0, r"{tmp_path}")
            te_stub = load("te_stub")
            assert te_stub.install_if_absent() is False
            import transformer_engine
            assert transformer_engine.REAL and not getattr(transformer_engine, "__te_stub__", False)
            print("real-te-kept")
            """
        ),
        timeout=60,
    )
    assert "real-te-kept" in out.stdout


def test_cpu_shims_are_inactive_when_cuda_is_available():
    """Simulated CUDA: torch.cuda's functions must stay untouched."""
    out = run_python(
        _LOAD
        + textwrap.dedent(
            """
            import torch
            before = (torch.cuda.current_device, torch.cuda.manual_seed, torch.cuda.get_rng_state, torch.cuda.Stream)
            cpu = load("cpu")
            assert cpu.install_if_no_cuda(cuda_available=True) is False
            assert (torch.cuda.current_device, torch.cuda.manual_seed, torch.cuda.get_rng_state, torch.cuda.Stream) == before
            print("cuda-untouched")
            """
        ),
        timeout=60,
    )
    assert "cuda-untouched" in out.stdout


def _megatron_draws(seed: int, tp_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed megatron's RNG for one (tp, ep=0, etp=0) rank; return draws from its tensor-parallel state (under the
    tracker's fork) and then from the default state."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(16, device=device).cpu()
    return forked, torch.rand(16, device=device).cpu()


def test_cpu_shims_are_active_exactly_without_cuda_and_seed_megatron_rng(impl):
    """Megatron's seeding (``model_parallel_cuda_manual_seed`` + the tracker's ``fork``) works on this host: the
    same seed replays the same draws, another seed or tensor-parallel rank draws differently, the tensor-parallel
    state is not the default one, and leaving the fork resumes the default state where seeding left it."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    assert impl.compat_report().cpu_shims is (not cuda), f"cpu_shims={impl.compat_report().cpu_shims}, cuda={cuda}"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        assert torch.cuda.current_device() == torch.device("cpu")
        device = torch.device("cpu")
    saved_tracker, saved_cpu = get_cuda_rng_tracker().get_states(), torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state() if cuda else None
    try:
        forked, after = _megatron_draws(1234, 0, device)
        again_forked, again_after = _megatron_draws(1234, 0, device)
        other_seed, _ = _megatron_draws(4321, 0, device)
        other_rank, _ = _megatron_draws(1234, 1, device)
        model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)  # the same seed, no fork
        default_only = torch.rand(16, device=device).cpu()
    finally:
        get_cuda_rng_tracker().set_states(saved_tracker)
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda)
    assert torch.equal(forked, again_forked) and torch.equal(after, again_after), "one seed, two different streams"
    assert not torch.equal(forked, other_seed), "seeds 1234 and 4321 drew the same tensor-parallel numbers"
    assert not torch.equal(forked, other_rank), "tensor-parallel ranks 0 and 1 drew the same numbers"
    assert not torch.equal(forked, after), "the forked tensor-parallel state is the default state"
    assert torch.equal(after, default_only), "forking the tracker moved the default state"


def test_mla_fix_is_skipped_when_upstream_accepts_k_channels():
    """Simulated upstream fix: a DotProductAttention that already takes k_channels is left alone."""
    out = run_python(
        _LOAD
        + textwrap.dedent(
            """
            from megatron.core.transformer.dot_product_attention import DotProductAttention
            original = DotProductAttention.__init__
            def __init__(self, *a, k_channels=None, v_channels=None, **k):
                original(self, *a, **k)
            DotProductAttention.__init__ = __init__
            mla = load("mla")
            assert mla.install_if_needed() is False
            assert DotProductAttention.__init__ is __init__
            print("upstream-kept")
            """
        ),
        timeout=120,
    )
    assert "upstream-kept" in out.stdout


def test_local_spec_mla_attention_runs_forward_and_backward(impl, tmp_path):
    """Regression: without the fix, MLASelfAttention on the local spec raises TypeError(k_channels)."""
    out = run_python(
        textwrap.dedent(
            f"""
            import {impl.name} as implementation; implementation.compat_report()
            import torch, torch.nn.functional as F
            import torch.distributed as dist
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
            from megatron.core.transformer.transformer_config import MLATransformerConfig
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.models.gpt import GPTModel
            dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(1)
            cfg = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=16,
                kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="rope",
                qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                params_dtype=torch.float32, gated_linear_unit=True, activation_func=F.silu, ffn_hidden_size=64)
            m = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True),
                vocab_size=64, max_sequence_length=16)
            ids = torch.randint(0, 64, (2, 8))
            mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
            out = m(ids, torch.arange(8).expand(2, 8), mask)
            out.float().sum().backward()
            assert torch.isfinite(out).all()
            print("mla-ok", tuple(out.shape))
            """
        ),
        timeout=180,
    )
    assert "mla-ok (2, 8, 64)" in out.stdout

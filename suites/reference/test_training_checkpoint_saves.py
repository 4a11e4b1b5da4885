"""What a training checkpoint holds (the adapter, its optimizer state, the generators, the trainer state), and every
save that must not happen refused with nothing written and an earlier checkpoint's bytes kept, on one rank in this
process; a one-process run without a process group included. The resume: ``test_training_checkpoint.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fixtures.data.training_runs import (
    ALPHA,
    FILES,
    LR,
    MASTERS,
    R,
    Run,
    checkpoint_fixtures,
    differing,
    one_rank_run,
    sha256_of,
)

pytestmark = pytest.mark.cpu


base, saved, ckpt = checkpoint_fixtures()


@MASTERS
def test_the_checkpoint_holds_the_adapter_its_optimizer_state_the_generators_and_the_trainer_state(
    impl, base, tmp_path, masters
):
    """The four files and ``.complete`` certifying them: the gathered adapter in its own dtype; every optimizer
    state tensor per parameter (fp32 masters too, where the parameters are not fp32); rank 0's generator state at
    the save; the step, the layout, the LoRA and optimizer hyper-parameters, the base fingerprint and ``extra``."""
    run = one_rank_run(impl, base, masters=masters)
    for k in (1, 2):
        run.step(k)
    rng = torch.get_rng_state()
    out = run.save(tmp_path / "ckpt", 2, base=base, extra={"epoch": 1})
    assert out == (tmp_path / "ckpt").absolute(), out
    assert sorted(p.name for p in out.iterdir()) == sorted([".complete", *FILES]), sorted(out.iterdir())
    marker = json.loads((out / ".complete").read_text())
    assert marker["format"] == impl.CHECKPOINT_FORMAT == "dsv4-lora-training", marker
    assert marker["files"] == {f: sha256_of(out / f) for f in FILES}, "the marker does not certify the files' bytes"

    adapter = load_file(str(out / "adapter.safetensors"))
    gathered = impl.gather_adapter_state(run.chunks, run.handle).tensors
    assert not differing(adapter, dict(gathered)), f"not the gathered adapter: {differing(adapter, dict(gathered))}"
    assert {t.dtype for t in adapter.values()} == {torch.bfloat16 if masters else torch.float32}

    optimizer = load_file(str(out / "optimizer.safetensors"))
    keys = ("exp_avg", "exp_avg_sq", "step", *(("master",) if masters else ()))
    assert sorted(optimizer) == sorted(f"{k}/{n}" for k in keys for n in adapter), sorted(optimizer)[:6]
    for n, t in adapter.items():
        assert optimizer[f"step/{n}"].dim() == 0 and optimizer[f"step/{n}"].item() == 2, f"step/{n}"
        assert optimizer[f"exp_avg/{n}"].shape == t.shape, f"exp_avg/{n}: not the full parameter's shape"
        if masters:
            master = optimizer[f"master/{n}"]
            assert master.dtype == torch.float32 and torch.equal(master.to(t.dtype), t), f"master/{n}"

    generators = load_file(str(out / "rng.safetensors"))
    assert torch.equal(generators["rank0/cpu"], rng), "not the generator at the save"
    # the CUDA generator exactly where there is one (the CPU stand-ins answer for it on a host without CUDA)
    assert ("rank0/cuda" in generators) == torch.cuda.is_available(), sorted(generators)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = {f"rank0/tracker.{n}": t for n, t in get_cuda_rng_tracker().get_states().items()}
    assert tracker, "Megatron's tracker holds no generator: seeding did not reach it"
    assert not differing({n: t for n, t in generators.items() if n.startswith("rank0/tracker.")}, tracker), (
        "not Megatron's tensor-parallel generators at the save"
    )

    state = json.loads((out / "trainer_state.json").read_text())
    assert (state["format"], state["version"], state["step"]) == ("dsv4-lora-training", 1, 2), state
    assert state["layout"] == {"world": 1, "tp": 1, "pp": 1, "ep": 1}, state["layout"]
    assert state["lora"] == {"r": R, "alpha": ALPHA, "dropout": 0.0}, state["lora"]
    (group,) = state["param_groups"]
    assert group["lr"] == LR and group["betas"] == [0.9, 0.999] and "params" not in group, group
    (held,) = getattr(run.opt, "optimizer", run.opt).param_groups
    assert group == {k: list(v) if isinstance(v, tuple) else v for k, v in held.items() if k != "params"}, (
        "not every hyper-parameter of the optimizer's group"
    )
    names = sorted(state["base_fingerprint"]["tensors"])
    assert state["base_fingerprint"] == impl.base_fingerprint(base, names), "not the base's fingerprint"
    assert state["extra"] == {"epoch": 1}, state["extra"]


def _nan_lora(run: Run) -> None:
    with torch.no_grad():
        next(p for c in run.chunks for p in c.parameters() if p.requires_grad).view(-1)[0] = float("nan")


def _nan_exp_avg(run: Run) -> None:
    next(iter(run.opt.state.values()))["exp_avg"].view(-1)[0] = float("nan")


def _forget_one_state(run: Run) -> None:
    run.opt.state.pop(next(iter(run.opt.state)))


def _untrained_lora(run: Run) -> None:
    params = [p for c in run.chunks for p in c.parameters() if p.requires_grad]
    run.opt = torch.optim.Adam(params[1:], lr=LR)


def _trained_non_lora(run: Run) -> None:
    params = [p for c in run.chunks for p in c.parameters() if p.requires_grad]
    run.opt = torch.optim.Adam([*params, torch.nn.Parameter(torch.zeros(3, 5))], lr=LR)


def _foreign_optimizer(run: Run) -> None:
    run.opt = object()


def _masters_without_a_torch_optimizer(run: Run) -> None:
    """Looks like impl.AdapterOptimizer (params and their masters) but steps no torch optimizer."""
    from types import SimpleNamespace

    params = [p for c in run.chunks for p in c.parameters() if p.requires_grad]
    run.opt = SimpleNamespace(params=params, masters=[p.detach().float() for p in params], optimizer=None)


#: label -> (what is wrong with the run at the save, save keywords, what the refusal says)
SAVE_REFUSALS = {
    "nan-lora": (_nan_lora, {}, ("phase write", "adapter.safetensors", "NaN or Inf", "diverged")),
    "nan-optimizer-state": (_nan_exp_avg, {}, ("phase write", "optimizer.safetensors: exp_avg/", "NaN or Inf")),
    "state-keys-differ": (_forget_one_state, {}, ("phase gather", "optimizer state keys differ")),
    "untrained-lora": (_untrained_lora, {}, ("phase prepare", "the optimizer does not train this LoRA parameter")),
    "trained-non-lora": (_trained_non_lora, {}, ("phase prepare", "shape [3, 5] is trained but is no LoRA")),
    "masters-without-a-torch-optimizer": (_masters_without_a_torch_optimizer, {},
                                          ("phase prepare", "optimizer SimpleNamespace", "the state of a torch optimizer")),
    "foreign-optimizer": (_foreign_optimizer, {}, ("phase prepare", "optimizer object", "the state of a torch optimizer")),
    "writer-past-the-world": (lambda run: None, {"writer_rank": 1}, ("writer_rank=1 is outside the world of 1",)),
    "writer-far-past-the-world": (lambda run: None, {"writer_rank": 2}, ("writer_rank=2 is outside the world of 1",)),
    "negative-writer": (lambda run: None, {"writer_rank": -1}, ("writer_rank=-1 is outside the world of 1",)),
}  # fmt: skip


@pytest.mark.parametrize("label", list(SAVE_REFUSALS))
def test_a_save_that_must_not_happen_is_refused_and_the_earlier_checkpoint_keeps_its_bytes(
    impl, base, ckpt, tmp_path, label
):
    """A diverged run (NaN in a LoRA parameter or its optimizer state), an optimizer that does not match the LoRA
    parameters, a writer outside the world: TrainingCheckpointError naming the phase, and the checkpoint already at
    that path keeps its bytes, with nothing beside it."""
    spoil, kw, says = SAVE_REFUSALS[label]
    before = {p.name: sha256_of(p) for p in ckpt.iterdir()}
    run = one_rank_run(impl, base)
    run.step(1)
    spoil(run)
    with pytest.raises(impl.TrainingCheckpointError) as err:
        run.save(ckpt, 3, **kw)
    message = str(err.value)
    assert all(s in message for s in says), f"{label}: the refusal does not say {says}: {message}"
    assert f"{ckpt} is as it was" in message, message
    assert {p.name: sha256_of(p) for p in ckpt.iterdir()} == before, f"{label}: the earlier checkpoint changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], f"{label}: {sorted(tmp_path.iterdir())}"


def test_a_checkpoint_before_the_first_step_holds_no_optimizer_state_and_resumes(impl, base, tmp_path):
    run = one_rank_run(impl, base)
    out = run.save(tmp_path / "ckpt", 0)
    assert load_file(str(out / "optimizer.safetensors")) == {}, "an optimizer that never stepped has no state"
    again = one_rank_run(impl, base, seed=999)
    assert again.resume(out).step == 0
    assert not differing(again.lora(), run.lora()), "the resumed adapter is not the saved one"


def test_a_model_without_lora_is_not_checkpointed(impl, base, tmp_path):
    """Nothing to resume from: refused in the write phase, naming the cause, and nothing written."""
    from transformers import DeepseekV4Config

    from fixtures.data.native_weights import ensure_single_rank_megatron

    ensure_single_rank_megatron(impl)
    chunks = impl.build_native_model(DeepseekV4Config.from_pretrained(base))
    optimizer = torch.optim.Adam([{"params": []}], lr=LR)  # trains nothing, as a run without LoRA would
    with pytest.raises(impl.TrainingCheckpointError, match="phase write") as err:
        impl.save_training_checkpoint(chunks, optimizer, tmp_path / "ckpt", step=1, handle=None)
    assert "holds no LoRA parameters: apply LoRA before checkpointing" in str(err.value), err.value
    assert list(tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())


ONE_PROCESS = {"world": 1, "tp": 1, "pp": 1, "ep": 1}


def _without_a_process_group(mp: pytest.MonkeyPatch) -> None:
    """torch.distributed and Megatron answer as in a process that has no process group: ``is_initialized()`` is
    False and every call on the default group raises as torch's do there. The stand-in for a one-process run whose
    group is gone by the save or the resume (building the model needs Megatron's parallel state, so the test builds
    under it first)."""
    import torch.distributed.distributed_c10d as c10d
    from megatron.core import parallel_state

    mp.setattr(c10d._world, "default_pg", None)
    mp.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)


def test_a_one_process_run_without_a_process_group_records_the_one_process_layout_a_resume_reads(impl, base, tmp_path):
    """Saved where there is no process group, the checkpoint records world 1 and TP = PP = EP = 1: a one-rank run
    resumes it at its own layout and restores the generators. Resumed where there is no process group, the same
    checkpoint is at that process's layout as well."""
    run = one_rank_run(impl, base)
    run.step(1)
    with pytest.MonkeyPatch.context() as mp:
        _without_a_process_group(mp)
        assert not torch.distributed.is_initialized()
        out = run.save(tmp_path / "ckpt", 1)
    assert json.loads((out / "trainer_state.json").read_text())["layout"] == ONE_PROCESS
    saved_rng = load_file(str(out / "rng.safetensors"))["rank0/cpu"]

    info = one_rank_run(impl, base, seed=999).resume(out)
    assert (info.saved_layout, info.layout, info.rng_restored) == (ONE_PROCESS, ONE_PROCESS, True), info
    assert torch.equal(torch.get_rng_state(), saved_rng), "the generator was not restored at the same layout"

    again = one_rank_run(impl, base, seed=998)
    with pytest.MonkeyPatch.context() as mp:
        _without_a_process_group(mp)
        info = again.resume(out)
    assert (info.saved_layout, info.layout, info.rng_restored) == (ONE_PROCESS, ONE_PROCESS, True), info
    assert not differing(again.lora(), run.lora()), "the resumed adapter is not the saved one"


def test_a_save_that_returns_has_written_its_checkpoint_whatever_integer_names_the_writer(impl, base, tmp_path):
    """``writer_rank`` as a numpy integer (as a rank table or a parsed config hands it over): the save either
    refuses it, writing nothing, or writes the checkpoint; it never returns having written nothing."""
    import numpy as np

    run = one_rank_run(impl, base)
    run.step(1)
    try:
        out = run.save(tmp_path / "ckpt", 1, writer_rank=np.int64(0))
    except (impl.TrainingCheckpointError, TypeError):
        assert list(tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())
        return
    assert impl.read_training_checkpoint(out).state["step"] == 1, "the save returned without a checkpoint"


def test_the_save_takes_its_destination_by_name(impl, base, tmp_path):
    """``out_dir``, as the docstring names it, by keyword (the step, the handle and the options after it are
    keyword-only; the model chunks and the optimizer come first)."""
    run = one_rank_run(impl, base)
    out = impl.save_training_checkpoint(run.chunks, run.opt, out_dir=tmp_path / "ckpt", step=0, handle=run.handle)
    assert out == (tmp_path / "ckpt").absolute() and impl.read_training_checkpoint(out).state["step"] == 0

"""A training checkpoint and its resume on one rank, in this process: that a resumed run continues exactly, and every
refusal of the resume with nothing changed. What a save writes and refuses: ``test_training_checkpoint_saves.py``.

The multi-rank and relayout contract is ``suites/reference/test_training_resume.py``; these are the same promises
at world size 1, where a run costs a fraction of a second, so every branch of the resume is reached.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.data.training_runs import (
    LR,
    MASTERS,
    TARGETS,
    Run,
    checkpoint_fixtures,
    copy_checkpoint,
    differing,
    one_rank_run,
    sha256_of,
    tracker_draw,
)

pytestmark = pytest.mark.cpu


base, saved, ckpt = checkpoint_fixtures()


@MASTERS
def test_a_resumed_one_rank_run_equals_the_uninterrupted_one_bit_for_bit(impl, base, tmp_path, masters):
    """Steps 1-2, checkpoint, steps 3-4; a fresh run (other LoRA init, other learning rate, other generator state)
    resumed from the checkpoint trains steps 3-4 to the same losses, the same adapter and optimizer state, and the
    same next draws from the global and the tensor-parallel generators (restored: the layout is the saved one)."""
    first = one_rank_run(impl, base, masters=masters)
    for k in (1, 2):
        first.step(k)
    first.save(tmp_path / "ckpt", 2, base=base, extra={"data_position": 17})
    losses = [first.step(k) for k in (3, 4)]
    draw, tp_draw = torch.rand(4), tracker_draw()

    second = one_rank_run(impl, base, masters=masters, seed=999, lr=LR / 2)
    torch.manual_seed(12345)
    info = second.resume(tmp_path / "ckpt", base=base)
    assert (info.step, info.rng_restored, info.extra) == (2, True, {"data_position": 17}), info
    assert info.saved_layout == info.layout == {"world": 1, "tp": 1, "pp": 1, "ep": 1}, info
    assert info.path == (tmp_path / "ckpt").absolute(), info.path
    assert [second.step(k) for k in (3, 4)] == losses, "the resumed run's losses differ"
    assert torch.equal(torch.rand(4), draw), "the global generator was not restored"
    assert torch.equal(tracker_draw(), tp_draw), "Megatron's tensor-parallel generator was not restored"
    inner = getattr(second.opt, "optimizer", second.opt)
    assert [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in getattr(first.opt, "optimizer", first.opt).param_groups
    ], "the optimizer's hyper-parameters are not the saved ones (as the optimizer holds them: betas a tuple)"
    assert not differing(second.lora(), first.lora()), f"adapters differ: {differing(second.lora(), first.lora())}"
    assert not differing(second.optimizer_state(), first.optimizer_state()), "optimizer states differ"
    if masters:
        assert not differing(dict(enumerate(second.opt.masters)), dict(enumerate(first.opt.masters))), "masters differ"


def _recertify(ckpt: Path) -> None:
    """Rewrite ``.complete`` for the files as they now are (a checkpoint whose bytes are what its writer wrote)."""
    marker = json.loads((ckpt / ".complete").read_text())
    marker["files"] = {name: sha256_of(ckpt / name) for name in marker["files"]}
    (ckpt / ".complete").write_text(json.dumps(marker))


def _edit_tensors(file: str, edit):
    def spoil(ckpt: Path) -> None:
        save_file(edit(load_file(str(ckpt / file))), str(ckpt / file), metadata={"format": "pt"})
        _recertify(ckpt)

    return spoil


def _edit_state(edit):
    def spoil(ckpt: Path) -> None:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        edit(state)
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
        _recertify(ckpt)

    return spoil


def _write(name: str, data: bytes, recertify: bool = True):
    def spoil(ckpt: Path) -> None:
        (ckpt / name).write_bytes(data)
        if recertify:
            _recertify(ckpt)

    return spoil


def _nan_first(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = sorted(n for n, t in tensors.items() if t.dim() > 0)[0]
    tensors[name].view(-1)[0] = float("nan")
    return tensors


def _drop_first(prefix: str):
    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors.pop(sorted(n for n in tensors if n.startswith(prefix))[0])
        return tensors

    return edit


def _torn(digest_sorts_after: bool):
    """One bit of the optimizer state's last values flipped: a readable file of finite numbers, only the hash tells.
    The bit is chosen so the new digest sorts after (or before) the certified one: a mismatch either way refuses."""

    def spoil(ckpt: Path) -> None:
        import hashlib

        file = ckpt / "optimizer.safetensors"
        data, certified = file.read_bytes(), json.loads((ckpt / ".complete").read_text())["files"][file.name]
        for at in range(len(data) - 4, len(data) - 64, -4):  # the lowest mantissa byte of each of the last floats
            torn = bytearray(data)
            torn[at] ^= 1
            if (hashlib.sha256(torn).hexdigest() > certified) == digest_sorts_after:
                file.write_bytes(bytes(torn))
                return
        raise AssertionError("no bit flip gave a digest on the wanted side")

    return spoil


def _other_base(state: dict) -> None:
    name = next(iter(state["base_fingerprint"]["tensors"]))
    state["base_fingerprint"]["tensors"][name]["sha256"] = "0" * 64


def _marker(edit):
    def spoil(ckpt: Path) -> None:
        marker = json.loads((ckpt / ".complete").read_text())
        edit(marker)
        (ckpt / ".complete").write_text(json.dumps(marker))

    return spoil


#: label -> (how a good checkpoint is spoiled, the file the refusal names, what else it says)
SPOILED = {
    "no-marker": (lambda c: (c / ".complete").unlink(), ".complete", "interrupted or partial"),
    "unreadable-marker": (_write(".complete", b"{not json", recertify=False), ".complete", "unreadable"),
    "marker-without-files": (_marker(lambda m: m.pop("files")), ".complete", "unreadable"),
    "marker-files-not-a-table": (_marker(lambda m: m.update(files=5)), ".complete", "unreadable"),
    "an-exported-adapter": (_marker(lambda m: m.update(format="dsv4-lora-adapter")), ".complete", "import_adapter"),
    "marker-of-a-newer-format": (_marker(lambda m: m.update(format="dsv4-lora-training-2")), ".complete",
                                 "not a training checkpoint"),
    "file-missing": (lambda c: (c / "rng.safetensors").unlink(), "rng.safetensors", "missing from the checkpoint"),
    "file-uncertified": (_marker(lambda m: m["files"].pop("rng.safetensors")), "rng.safetensors", "missing"),
    "torn-file": (_torn(digest_sorts_after=False), "optimizer.safetensors", "torn or edited"),
    "torn-file-other-digest": (_torn(digest_sorts_after=True), "optimizer.safetensors", "torn or edited"),
    "state-not-json": (_write("trainer_state.json", b"{step: 2"), "trainer_state.json", "not JSON"),
    "state-of-another-format": (_edit_state(lambda s: s.update(format="other")), "trainer_state.json", "with a step"),
    "state-of-an-adapter-format": (_edit_state(lambda s: s.update(format="dsv4-lora-adapter")),
                                   "trainer_state.json", "with a step"),
    "state-without-a-step": (_edit_state(lambda s: s.pop("step")), "trainer_state.json", "with a step"),
    "state-with-a-text-step": (_edit_state(lambda s: s.update(step="2")), "trainer_state.json", "with a step"),
    "adapter-not-safetensors": (_write("adapter.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
                                "adapter.safetensors", "not a safetensors file"),
    "empty-adapter": (_edit_tensors("adapter.safetensors", lambda t: {}), "adapter.safetensors", "empty adapter"),
    "nan-adapter": (_edit_tensors("adapter.safetensors", _nan_first), "adapter.safetensors", "NaN or Inf"),
    "nan-optimizer": (_edit_tensors("optimizer.safetensors", _nan_first), "optimizer.safetensors", "NaN or Inf"),
    "other-targets": (_edit_tensors("adapter.safetensors", lambda t: {n: v for n, v in t.items() if ".wkv." not in n}),
                      "adapter.safetensors", "wkv"),
    "optimizer-entry-missing": (_edit_tensors("optimizer.safetensors", _drop_first("exp_avg/")), "optimizer.safetensors",
                                "is missing"),
    "other-lora-rank": (_edit_state(lambda s: s["lora"].update(r=8)), "trainer_state.json", "LoRA r=8 saved"),
    "other-lora-alpha": (_edit_state(lambda s: s["lora"].update(alpha=16.0)), "trainer_state.json", "alpha=16.0"),
    "state-without-lora": (_edit_state(lambda s: s.pop("lora")), "trainer_state.json", "LoRA r=None saved"),
    "other-base": (_edit_state(_other_base), "trainer_state.json", "base"),
    "no-base-recorded": (_edit_state(lambda s: s.update(base_fingerprint=None)), "trainer_state.json",
                         "records no base fingerprint"),
    "other-param-groups": (_edit_state(lambda s: s["param_groups"].append(dict(s["param_groups"][0]))),
                           "trainer_state.json", "2 optimizer parameter groups saved, this optimizer has 1"),
    "fewer-param-groups": (_edit_state(lambda s: s.update(param_groups=[])), "trainer_state.json",
                           "0 optimizer parameter groups saved, this optimizer has 1"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(SPOILED))
def test_a_checkpoint_that_must_not_be_resumed_is_refused_naming_its_file_and_nothing_changes(impl, base, ckpt, label):
    """Each spoilt copy of a good checkpoint is refused with TrainingCheckpointError naming the file and what is
    wrong with it; the run's LoRA parameters and optimizer state are as they were (never a silent fresh start)."""
    spoil, file, says = SPOILED[label]
    spoil(ckpt)
    run = one_rank_run(impl, base)
    run.step(1)
    lora, state = run.lora(), run.optimizer_state()
    with pytest.raises(impl.TrainingCheckpointError) as err:
        run.resume(ckpt, base=base)
    message = str(err.value)
    assert str(ckpt / file) in message, f"{label}: the refusal does not name {ckpt / file}: {message}"
    assert says in message, f"{label}: the refusal does not say {says!r}: {message}"
    assert not differing(run.lora(), lora), f"{label}: a refused resume changed {differing(run.lora(), lora)}"
    assert not differing(run.optimizer_state(), state), f"{label}: a refused resume changed the optimizer state"


def test_a_resume_from_nothing_or_into_other_targets_is_refused(impl, base, saved, tmp_path):
    """No directory at the path; a model with a LoRA on targets the checkpoint lacks."""
    run = one_rank_run(impl, base)
    with pytest.raises(impl.TrainingCheckpointError, match="not a directory") as err:
        run.resume(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in str(err.value), err.value
    wider = one_rank_run(impl, base, targets=(*TARGETS, "wq_b"))
    with pytest.raises(impl.TrainingCheckpointError, match="wq_b") as err:
        wider.resume(saved[0])
    assert str(saved[0] / "adapter.safetensors") in str(err.value), err.value


def test_a_checkpoint_without_a_base_fingerprint_resumes_when_no_base_is_given(impl, base, saved):
    run = one_rank_run(impl, base)
    assert run.resume(saved[1]).step == 2
    assert json.loads((saved[1] / "trainer_state.json").read_text())["base_fingerprint"] is None


def test_a_resume_without_the_lora_handle_restores_the_adapter(impl, base, saved):
    """The handle only adds the r/alpha check: without it the checkpoint's adapter is restored all the same."""
    run = one_rank_run(impl, base, seed=999)
    info = impl.resume_training(run.chunks, run.opt, saved[0])
    assert info.step == 2
    assert not differing(run.lora(), one_rank_run(impl, base).resumed_lora(saved[0])), "not the checkpoint's adapter"


def _one_group_per_parameter(run: Run, lr: float, groups: int) -> Run:
    """``run`` with an optimizer of one parameter group per LoRA parameter, each with its own learning rate, then
    empty groups up to ``groups`` in all."""
    params = [[p] for c in run.chunks for p in c.parameters() if p.requires_grad]
    params += [[]] * (groups - len(params))
    run.opt = torch.optim.Adam([{"params": ps, "lr": lr * (1 + i)} for i, ps in enumerate(params)], lr=lr)
    return run


def test_an_optimizer_of_hundreds_of_parameter_groups_resumes_each_groups_own_hyper_parameters(impl, base, tmp_path):
    """300 groups, as a per-parameter recipe on a full model has (past 256, where CPython's int identity and
    equality part): each comes back with its own learning rate, in order, with the adapter and optimizer state."""
    first = _one_group_per_parameter(one_rank_run(impl, base), LR, groups=300)
    first.step(1)
    ckpt = first.save(tmp_path / "ckpt", 1)
    second = _one_group_per_parameter(one_rank_run(impl, base, seed=999), LR / 2, groups=300)
    assert second.resume(ckpt).step == 1
    hyper = lambda opt: [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]  # noqa: E731
    assert hyper(second.opt) == hyper(first.opt), "the groups' hyper-parameters are not the saved ones, in order"
    assert not differing(second.lora(), first.lora()), f"adapters differ: {differing(second.lora(), first.lora())}"
    assert not differing(second.optimizer_state(), first.optimizer_state()), "optimizer states differ"


def test_a_checkpoint_on_fp32_masters_missing_a_master_is_refused_naming_it(impl, base, tmp_path):
    run = one_rank_run(impl, base, masters=True)
    run.step(1)
    ckpt = run.save(tmp_path / "ckpt", 1)
    _edit_tensors("optimizer.safetensors", _drop_first("master/"))(ckpt)
    again = one_rank_run(impl, base, masters=True, seed=999)
    lora = again.lora()
    with pytest.raises(impl.TrainingCheckpointError, match="master/.* is missing") as err:
        again.resume(ckpt)
    assert str(ckpt / "optimizer.safetensors") in str(err.value), err.value
    assert not differing(again.lora(), lora), "a refused resume changed the adapter"


@pytest.mark.parametrize("saved_cuda", [True, False], ids=["saved-with-cuda", "saved-without-cuda"])
@pytest.mark.parametrize("host_cuda", [True, False], ids=["on-a-cuda-host", "on-a-cpu-host"])
def test_the_cuda_generator_is_restored_exactly_where_the_checkpoint_has_one_and_the_host_has_cuda(
    impl, base, ckpt, monkeypatch, saved_cuda, host_cuda
):
    """A checkpoint saved with or without CUDA, resumed on a host with or without it: the CPU generator is
    restored either way, the CUDA one only when both have it (the host's CUDA is stood in for: only whether it is
    there and what is set on it matter here)."""
    cpu = load_file(str(ckpt / "rng.safetensors"))["rank0/cpu"]
    cuda_state = torch.arange(16, dtype=torch.uint8)
    if saved_cuda:
        _edit_tensors("rng.safetensors", lambda t: t | {"rank0/cuda": cuda_state})(ckpt)
    run = one_rank_run(impl, base)
    set_on_cuda = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: host_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": set_on_cuda.append(state.clone()))
    assert run.resume(ckpt).rng_restored
    monkeypatch.undo()
    assert torch.equal(torch.get_rng_state(), cpu), "the CPU generator is not the saved one"
    want = [cuda_state] if saved_cuda and host_cuda else []
    assert len(set_on_cuda) == len(want) and all(map(torch.equal, set_on_cuda, want)), set_on_cuda


def test_a_trainer_state_without_extra_resumes_with_an_empty_extra(impl, base, ckpt):
    _edit_state(lambda s: s.pop("extra"))(ckpt)
    assert one_rank_run(impl, base).resume(ckpt, base=base).extra == {}


def test_a_checkpoint_of_another_layout_resumes_without_restoring_the_generators_and_says_so(impl, base, ckpt):
    _edit_state(lambda s: s["layout"].update(world=2, tp=2))(ckpt)
    run = one_rank_run(impl, base)
    torch.manual_seed(4321)
    expected = torch.get_rng_state()
    info = run.resume(ckpt, base=base)
    assert info.rng_restored is False and info.saved_layout == {"world": 2, "tp": 2, "pp": 1, "ep": 1}, info
    assert info.layout == {"world": 1, "tp": 1, "pp": 1, "ep": 1}, info
    assert torch.equal(torch.get_rng_state(), expected), "the generator was restored from another layout's rank 0"


def test_the_newest_complete_checkpoint_is_found_and_none_complete_is_an_error_not_a_fresh_start(impl, saved, tmp_path):
    """Under one root: the complete checkpoint of the highest step wins (the name breaks a tie), an incomplete
    newer one and hidden directories are skipped; only incomplete ones -> an error naming them; nothing (or no
    root) -> None, a fresh run."""
    root = tmp_path / "checkpoints"
    for name, step in (("b-step-2", 2), ("a-step-3", 3), ("c-step-3", 3), ("d-step-9", 9), (".e-step-12", 12)):
        copy_checkpoint(saved[0], root / name)
        _edit_state(lambda s, step=step: s.update(step=step))(root / name)
    (root / "d-step-9" / ".complete").unlink()
    (root / "notes.txt").write_text("not a checkpoint")
    assert impl.latest_training_checkpoint(root) == root / "c-step-3"
    assert impl.read_training_checkpoint(root / "c-step-3").state["step"] == 3
    for name in ("a-step-3", "b-step-2", "c-step-3"):
        shutil.rmtree(root / name)
    with pytest.raises(impl.TrainingCheckpointError, match="1 checkpoint\\(s\\), none complete") as err:
        impl.latest_training_checkpoint(root)
    assert str(root / "d-step-9") in str(err.value), err.value
    shutil.rmtree(root / "d-step-9")
    assert impl.latest_training_checkpoint(root) is None, "a root of hidden directories only is a fresh run"
    assert impl.latest_training_checkpoint(tmp_path / "nothing-here") is None


def _add_tensor(file: Path, tensor: str, dtype: str, shape: list[int], nbytes: int) -> None:
    """Append one tensor of safetensors dtype ``dtype`` (zero bytes) to ``file``, header and data alike."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + nbytes]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + body + bytes(nbytes))


@pytest.mark.parametrize(
    ("file", "dtype", "shape", "nbytes"),
    [
        ("optimizer.safetensors", "F8_E8M0", [4], 4),
        ("adapter.safetensors", "F4", [8], 4),
        ("rng.safetensors", "F6_E3M2", [8], 6),
    ],
)
def test_a_tensor_of_a_dtype_torch_cannot_load_is_refused_naming_the_file_and_the_tensor(
    impl, ckpt, file, dtype, shape, nbytes
):
    """A dtype the safetensors format has but torch's safetensors loader does not (F8_E8M0, F4, F6): the read
    refuses with TrainingCheckpointError naming the file and the tensor, not a bare KeyError of the dtype."""
    _add_tensor(ckpt / file, "odd/tensor", dtype, shape, nbytes)
    _recertify(ckpt)
    with pytest.raises(impl.TrainingCheckpointError) as err:
        impl.read_training_checkpoint(ckpt)
    message = str(err.value)
    assert str(ckpt / file) in message and "odd/tensor" in message and dtype in message, message


@pytest.mark.parametrize(("file", "dtype", "shape", "nbytes"), [("adapter.safetensors", "F8_E8M0", [4], 4),
                                                                ("rng.safetensors", "F6_E3M2", [8], 6)])  # fmt: skip
def test_the_refusal_of_a_dtype_torch_cannot_load_names_only_its_tensor_whatever_the_header_length(
    impl, saved, tmp_path, file, dtype, shape, nbytes
):
    """Beside the file's own tensors (F32 adapter weights, U8 generator states), whose dtypes sort before and after
    the unreadable one, for a name in capitals (sorting before the header's __metadata__) and for every header length
    (names of 0-15 more characters, its padding and size with them): the refusal names the tensor stored in that
    dtype, and none of the file's readable tensors."""
    readable = sorted(load_file(str(saved[0] / file)))
    for extra in range(16):
        ckpt = copy_checkpoint(saved[0], tmp_path / f"ckpt-{extra}")
        odd = "ODD/" + "t" * extra
        _add_tensor(ckpt / file, odd, dtype, shape, nbytes)
        _recertify(ckpt)
        with pytest.raises(impl.TrainingCheckpointError) as err:
            impl.read_training_checkpoint(ckpt)
        message = str(err.value)
        assert str(ckpt / file) in message and f"{odd} stored as {dtype}" in message, f"{odd}: {message}"
        assert not [n for n in readable if n in message], f"{odd}: readable tensors named as {dtype}: {message}"

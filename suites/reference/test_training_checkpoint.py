"""A training checkpoint and its resume on one rank, in this process: what the checkpoint holds, that a resumed run
continues exactly, and every refusal (of the save and of the resume) with nothing written or changed.

The multi-rank and relayout contract is ``suites/reference/test_training_resume.py``; these are the same promises
at world size 1, where a run costs a fraction of a second, so every branch of the save and the resume is reached.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.cpu

PRESET, BASE_SEED, R, ALPHA, LR = "tiny-mixed", 3, 4, 8.0, 1e-2
TARGETS = ("wq_a", "wkv", "wo_b")
FILES = ("adapter.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json")


@pytest.fixture(scope="module")
def base(tiny_ckpt_factory) -> str:
    return str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))


@dataclass
class Run:
    """One rank's model, LoRA handle and optimizer, built as a fresh run builds them."""

    impl: Any
    chunks: list
    handle: Any
    opt: Any
    vocab: int

    def step(self, k: int) -> float:
        """Adam step ``k`` on step-seeded tokens, then one draw from the global generator (as dropout draws)."""
        ids = torch.randint(0, self.vocab, (1, 8), generator=torch.Generator().manual_seed(1000 + k))
        loss = self.impl.adapter_train_step(self.chunks, ids, self.opt)
        torch.rand(3)
        return loss

    def lora(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for c in self.chunks for n, p in c.named_parameters() if p.requires_grad}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        inner = getattr(self.opt, "optimizer", self.opt)
        return {f"{i}/{k}": v.clone() for i, s in enumerate(inner.state.values()) for k, v in s.items()}

    def save(self, out: Path, step: int, **kw) -> Path:
        return self.impl.save_training_checkpoint(self.chunks, self.opt, out, step=step, handle=self.handle, **kw)

    def resume(self, where: Path, **kw):
        return self.impl.resume_training(self.chunks, self.opt, where, handle=self.handle, **kw)

    def resumed_lora(self, where: Path) -> dict[str, torch.Tensor]:
        self.resume(where)
        return self.lora()


def _seed_megatron(seed: int) -> None:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)


def _tracker_draw() -> torch.Tensor:
    """A draw from Megatron's tensor-parallel generator (what dropout inside a tensor-parallel region uses)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        return torch.rand(4)


def _run(impl, base: str, *, masters: bool = False, seed: int = 100, lr: float = LR, targets=TARGETS) -> Run:
    from transformers import DeepseekV4Config

    from fixtures.data.native_weights import ensure_single_rank_megatron

    ensure_single_rank_megatron(impl)
    hf_config = DeepseekV4Config.from_pretrained(base)
    _seed_megatron(seed)  # as Megatron's initialisation does: the tensor-parallel generators join the state
    torch.manual_seed(seed)
    hook = impl.make_lora_pre_wrap_hook(targets=list(targets), rank=R, alpha=ALPHA)
    load = lambda chunks: (impl.load_official_checkpoint(chunks, base), chunks)[1]  # noqa: E731
    dtype = torch.bfloat16 if masters else torch.float32
    chunks = impl.build_native_model(hf_config, pre_wrap_hooks=[load, hook], params_dtype=dtype)
    if masters:
        opt = impl.AdapterOptimizer(chunks, lr=lr)
    else:
        opt = torch.optim.Adam([p for c in chunks for p in c.parameters() if p.requires_grad], lr=lr)
    return Run(impl, chunks, hook.handle, opt, hf_config.vocab_size)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (or exist on one side only)."""
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


@pytest.mark.parametrize("masters", [False, True], ids=["fp32-adam", "bf16-on-fp32-masters"])
def test_a_resumed_one_rank_run_equals_the_uninterrupted_one_bit_for_bit(impl, base, tmp_path, masters):
    """Steps 1-2, checkpoint, steps 3-4; a fresh run (other LoRA init, other learning rate, other generator state)
    resumed from the checkpoint trains steps 3-4 to the same losses, the same adapter and optimizer state, and the
    same next draws from the global and the tensor-parallel generators (restored: the layout is the saved one)."""
    first = _run(impl, base, masters=masters)
    for k in (1, 2):
        first.step(k)
    first.save(tmp_path / "ckpt", 2, base=base, extra={"data_position": 17})
    losses = [first.step(k) for k in (3, 4)]
    draw, tracker_draw = torch.rand(4), _tracker_draw()

    second = _run(impl, base, masters=masters, seed=999, lr=LR / 2)
    torch.manual_seed(12345)
    info = second.resume(tmp_path / "ckpt", base=base)
    assert (info.step, info.rng_restored, info.extra) == (2, True, {"data_position": 17}), info
    assert info.saved_layout == info.layout == {"world": 1, "tp": 1, "pp": 1, "ep": 1}, info
    assert info.path == (tmp_path / "ckpt").absolute(), info.path
    assert [second.step(k) for k in (3, 4)] == losses, "the resumed run's losses differ"
    assert torch.equal(torch.rand(4), draw), "the global generator was not restored"
    assert torch.equal(_tracker_draw(), tracker_draw), "Megatron's tensor-parallel generator was not restored"
    inner = getattr(second.opt, "optimizer", second.opt)
    assert [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in getattr(first.opt, "optimizer", first.opt).param_groups
    ], "the optimizer's hyper-parameters are not the saved ones (as the optimizer holds them: betas a tuple)"
    assert not _equal(second.lora(), first.lora()), f"adapters differ: {_equal(second.lora(), first.lora())}"
    assert not _equal(second.optimizer_state(), first.optimizer_state()), "optimizer states differ"
    if masters:
        assert not _equal(dict(enumerate(second.opt.masters)), dict(enumerate(first.opt.masters))), "masters differ"


@pytest.fixture(scope="module")
def saved(impl, base, tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint after two Adam steps, with a base fingerprint (``with-base``) and without (``no-base``)."""
    root = tmp_path_factory.mktemp("training-checkpoints")
    run = _run(impl, base)
    for k in (1, 2):
        run.step(k)
    return run.save(root / "with-base", 2, base=base), run.save(root / "no-base", 2)


def _copy(ckpt: Path, to: Path) -> Path:
    shutil.copytree(ckpt, to)
    return to


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recertify(ckpt: Path) -> None:
    """Rewrite ``.complete`` for the files as they now are (a checkpoint whose bytes are what its writer wrote)."""
    marker = json.loads((ckpt / ".complete").read_text())
    marker["files"] = {name: _sha256(ckpt / name) for name in marker["files"]}
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
}  # fmt: skip


@pytest.mark.parametrize("label", list(SPOILED))
def test_a_checkpoint_that_must_not_be_resumed_is_refused_naming_its_file_and_nothing_changes(
    impl, base, saved, tmp_path, label
):
    """Each spoilt copy of a good checkpoint is refused with TrainingCheckpointError naming the file and what is
    wrong with it; the run's LoRA parameters and optimizer state are as they were (never a silent fresh start)."""
    spoil, file, says = SPOILED[label]
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    spoil(ckpt)
    run = _run(impl, base)
    run.step(1)
    lora, state = run.lora(), run.optimizer_state()
    with pytest.raises(impl.TrainingCheckpointError) as err:
        run.resume(ckpt, base=base)
    message = str(err.value)
    assert str(ckpt / file) in message, f"{label}: the refusal does not name {ckpt / file}: {message}"
    assert says in message, f"{label}: the refusal does not say {says!r}: {message}"
    assert not _equal(run.lora(), lora), f"{label}: a refused resume changed {_equal(run.lora(), lora)}"
    assert not _equal(run.optimizer_state(), state), f"{label}: a refused resume changed the optimizer state"


def test_a_resume_from_nothing_or_into_other_targets_is_refused(impl, base, saved, tmp_path):
    """No directory at the path; a model with a LoRA on targets the checkpoint lacks."""
    run = _run(impl, base)
    with pytest.raises(impl.TrainingCheckpointError, match="not a directory") as err:
        run.resume(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in str(err.value), err.value
    wider = _run(impl, base, targets=(*TARGETS, "wq_b"))
    with pytest.raises(impl.TrainingCheckpointError, match="wq_b") as err:
        wider.resume(saved[0])
    assert str(saved[0] / "adapter.safetensors") in str(err.value), err.value


def test_a_checkpoint_without_a_base_fingerprint_resumes_when_no_base_is_given(impl, base, saved):
    run = _run(impl, base)
    assert run.resume(saved[1]).step == 2
    assert json.loads((saved[1] / "trainer_state.json").read_text())["base_fingerprint"] is None


def test_a_resume_without_the_lora_handle_restores_the_adapter(impl, base, saved):
    """The handle only adds the r/alpha check: without it the checkpoint's adapter is restored all the same."""
    run = _run(impl, base, seed=999)
    info = impl.resume_training(run.chunks, run.opt, saved[0])
    assert info.step == 2
    assert not _equal(run.lora(), _run(impl, base).resumed_lora(saved[0])), "not the checkpoint's adapter"


def test_a_checkpoint_on_fp32_masters_missing_a_master_is_refused_naming_it(impl, base, tmp_path):
    run = _run(impl, base, masters=True)
    run.step(1)
    ckpt = run.save(tmp_path / "ckpt", 1)
    _edit_tensors("optimizer.safetensors", _drop_first("master/"))(ckpt)
    again = _run(impl, base, masters=True, seed=999)
    lora = again.lora()
    with pytest.raises(impl.TrainingCheckpointError, match="master/.* is missing") as err:
        again.resume(ckpt)
    assert str(ckpt / "optimizer.safetensors") in str(err.value), err.value
    assert not _equal(again.lora(), lora), "a refused resume changed the adapter"


@pytest.mark.parametrize("saved_cuda", [True, False], ids=["saved-with-cuda", "saved-without-cuda"])
@pytest.mark.parametrize("host_cuda", [True, False], ids=["on-a-cuda-host", "on-a-cpu-host"])
def test_the_cuda_generator_is_restored_exactly_where_the_checkpoint_has_one_and_the_host_has_cuda(
    impl, base, saved, tmp_path, monkeypatch, saved_cuda, host_cuda
):
    """A checkpoint saved with or without CUDA, resumed on a host with or without it: the CPU generator is
    restored either way, the CUDA one only when both have it (the host's CUDA is stood in for: only whether it is
    there and what is set on it matter here)."""
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    cpu = load_file(str(ckpt / "rng.safetensors"))["rank0/cpu"]
    cuda_state = torch.arange(16, dtype=torch.uint8)
    if saved_cuda:
        _edit_tensors("rng.safetensors", lambda t: t | {"rank0/cuda": cuda_state})(ckpt)
    run = _run(impl, base)
    set_on_cuda = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: host_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": set_on_cuda.append(state.clone()))
    assert run.resume(ckpt).rng_restored
    monkeypatch.undo()
    assert torch.equal(torch.get_rng_state(), cpu), "the CPU generator is not the saved one"
    want = [cuda_state] if saved_cuda and host_cuda else []
    assert len(set_on_cuda) == len(want) and all(map(torch.equal, set_on_cuda, want)), set_on_cuda


def test_a_trainer_state_without_extra_resumes_with_an_empty_extra(impl, base, saved, tmp_path):
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    _edit_state(lambda s: s.pop("extra"))(ckpt)
    assert _run(impl, base).resume(ckpt, base=base).extra == {}


def test_a_checkpoint_of_another_layout_resumes_without_restoring_the_generators_and_says_so(
    impl, base, saved, tmp_path
):
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    _edit_state(lambda s: s["layout"].update(world=2, tp=2))(ckpt)
    run = _run(impl, base)
    torch.manual_seed(4321)
    expected = torch.get_rng_state()
    info = run.resume(ckpt, base=base)
    assert info.rng_restored is False and info.saved_layout == {"world": 2, "tp": 2, "pp": 1, "ep": 1}, info
    assert info.layout == {"world": 1, "tp": 1, "pp": 1, "ep": 1}, info
    assert torch.equal(torch.get_rng_state(), expected), "the generator was restored from another layout's rank 0"


@pytest.mark.parametrize("masters", [False, True], ids=["fp32-adam", "bf16-on-fp32-masters"])
def test_the_checkpoint_holds_the_adapter_its_optimizer_state_the_generators_and_the_trainer_state(
    impl, base, tmp_path, masters
):
    """The four files and ``.complete`` certifying them: the gathered adapter in its own dtype; every optimizer
    state tensor per parameter (fp32 masters too, where the parameters are not fp32); rank 0's generator state at
    the save; the step, the layout, the LoRA and optimizer hyper-parameters, the base fingerprint and ``extra``."""
    run = _run(impl, base, masters=masters)
    for k in (1, 2):
        run.step(k)
    rng = torch.get_rng_state()
    out = run.save(tmp_path / "ckpt", 2, base=base, extra={"epoch": 1})
    assert out == (tmp_path / "ckpt").absolute(), out
    assert sorted(p.name for p in out.iterdir()) == sorted([".complete", *FILES]), sorted(out.iterdir())
    marker = json.loads((out / ".complete").read_text())
    assert marker["format"] == impl.CHECKPOINT_FORMAT == "dsv4-lora-training", marker
    assert marker["files"] == {f: _sha256(out / f) for f in FILES}, "the marker does not certify the files' bytes"

    adapter = load_file(str(out / "adapter.safetensors"))
    gathered = impl.gather_adapter_state(run.chunks, run.handle).tensors
    assert not _equal(adapter, dict(gathered)), f"not the gathered adapter: {_equal(adapter, dict(gathered))}"
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
    assert not _equal({n: t for n, t in generators.items() if n.startswith("rank0/tracker.")}, tracker), (
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
    impl, base, saved, tmp_path, label
):
    """A diverged run (NaN in a LoRA parameter or its optimizer state), an optimizer that does not match the LoRA
    parameters, a writer outside the world: TrainingCheckpointError naming the phase, and the checkpoint already at
    that path keeps its bytes, with nothing beside it."""
    spoil, kw, says = SAVE_REFUSALS[label]
    target = _copy(saved[0], tmp_path / "ckpt")
    before = {p.name: _sha256(p) for p in target.iterdir()}
    run = _run(impl, base)
    run.step(1)
    spoil(run)
    with pytest.raises(impl.TrainingCheckpointError) as err:
        run.save(target, 3, **kw)
    message = str(err.value)
    assert all(s in message for s in says), f"{label}: the refusal does not say {says}: {message}"
    assert f"{target} is as it was" in message, message
    assert {p.name: _sha256(p) for p in target.iterdir()} == before, f"{label}: the earlier checkpoint changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], f"{label}: {sorted(tmp_path.iterdir())}"


def test_a_checkpoint_before_the_first_step_holds_no_optimizer_state_and_resumes(impl, base, tmp_path):
    run = _run(impl, base)
    out = run.save(tmp_path / "ckpt", 0)
    assert load_file(str(out / "optimizer.safetensors")) == {}, "an optimizer that never stepped has no state"
    again = _run(impl, base, seed=999)
    assert again.resume(out).step == 0
    assert not _equal(again.lora(), run.lora()), "the resumed adapter is not the saved one"


def test_the_newest_complete_checkpoint_is_found_and_none_complete_is_an_error_not_a_fresh_start(impl, saved, tmp_path):
    """Under one root: the complete checkpoint of the highest step wins (the name breaks a tie), an incomplete
    newer one and hidden directories are skipped; only incomplete ones -> an error naming them; nothing (or no
    root) -> None, a fresh run."""
    root = tmp_path / "checkpoints"
    for name, step in (("b-step-2", 2), ("a-step-3", 3), ("c-step-3", 3), ("d-step-9", 9), (".e-step-12", 12)):
        _copy(saved[0], root / name)
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

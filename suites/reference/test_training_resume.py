"""A LoRA run resumes exactly from its training checkpoint, at its own layout or another.

Per layout (TP=2, EP=2, PP=2 on gloo): an uninterrupted run trains 4 Adam steps and checkpoints after step 2
(``impl.save_training_checkpoint``); a second run, started fresh at the same layout, resumes from that checkpoint
(``impl.resume_training``) and trains steps 3-4. Every loss, the final adapter and the final logits must equal the
uninterrupted run's bit for bit, and so must a draw from the random generator after the loop (each step draws
from it, as dropout and shuffling do: a resume that does not restore the generators draws differently).

At another layout (TP 2->1, TP 1->2, PP 1->2, PP 2->1, EP 1->2, EP 2->1, world 2->1) the resumed model's logits
equal the saved model's, and the next steps' losses and logits equal the uninterrupted run's, within the fp32
rounding of two layouts summing in different orders; the generators are not restored there, and the resume says
so. A checkpoint that must not be resumed is refused with an error naming its file, and nothing changes.
"""

from __future__ import annotations

import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.loop_rank_fns import (
    BASE_SEED,
    PRESET,
    SAVE_AT,
    STEPS,
    LoopCase,
    ckpt_name,
    loop_case,
    loop_root,
    run_loop,
    uninterrupted_run,
)
from tiny_models.presets import get_preset

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("training-loop")]

#: units of eps(float32) * max|logits|: two fp32 forwards of one function at two layouts (qualify's reload figure,
#: the analysis in suites/reference/test_adapter_roundtrip.py); the same units of eps * |loss| for a loss
ULPS = 256


@pytest.fixture(scope="module")
def base(tiny_ckpt_factory) -> str:
    return str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return loop_root(tmp_path_factory)


def _run(impl, case: LoopCase, layout: str) -> list[dict]:
    return run_loop(impl.name, case, layout)


def _case(impl, base: str, layout: str, **kw) -> LoopCase:
    return loop_case(impl.name, base, layout, **kw)


def uninterrupted(impl, base: str, root, layout: str, **kw) -> list[dict]:
    return uninterrupted_run(impl.name, base, root, layout, **kw)


def resumed(impl, base: str, root, saved: str, layout: str, **kw) -> list[dict]:
    uninterrupted(impl, base, root, saved, **kw)
    return _run(impl, _case(impl, base, layout, resume_from=str(root / ckpt_name(saved, **kw)), **kw), layout)


def _t(a) -> torch.Tensor:
    return torch.from_numpy(a)


def _ts(arrays: dict) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


def _last(payloads: list[dict], key: str):
    """The value from the last rank holding ``key`` (logits live on the last pipeline stage)."""
    return torch.from_numpy(next(p[key] for p in reversed(payloads) if p.get(key) is not None))


EXACT = {
    "tp2": ("tp2", {}),
    "ep2": ("ep2", {}),
    "pp2": ("pp2", {}),
    "pp2-bf16-fp32-masters": ("pp2", {"dtype": "bfloat16", "optimizer": "masters"}),
}


@pytest.mark.parametrize("variant", list(EXACT))
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(impl, base, ckpt_root, variant):
    """fp32 with torch Adam at each layout; bf16 LoRA parameters on impl.AdapterOptimizer's fp32 masters (the
    recipe's dtype: the masters and their moments must come back, not the rounded bf16 values)."""
    layout, kw = EXACT[variant]
    want = uninterrupted(impl, base, ckpt_root, layout, **kw)
    got = resumed(impl, base, ckpt_root, layout, layout, **kw)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"{variant} rank {rank}"
        assert g["resumed"] == {"step": SAVE_AT, "rng_restored": True, "saved_layout": g["resumed"]["saved_layout"]}, (
            f"{where}: {g['resumed']}"
        )
        assert sorted(g["losses"]) == list(range(SAVE_AT + 1, STEPS + 1)), (
            f"{where}: trained steps {sorted(g['losses'])}"
        )
        for step, loss in g["losses"].items():
            assert loss == w["losses"][step], (
                f"{where} step {step}: loss {loss!r} resumed, {w['losses'][step]!r} uninterrupted"
            )
        ah.assert_bitwise_equal(
            _t(g["rng_draw"]), _t(w["rng_draw"]), name="a random draw after the loop", context=where
        )
        if g.get("final_logits") is not None:
            ah.assert_bitwise_equal(_t(g["final_logits"]), _t(w["final_logits"]), name="final logits", context=where)
    ah.assert_state_dicts_bitwise_equal(
        _ts(got[0]["adapter"]), _ts(want[0]["adapter"]), context=f"{variant}: final adapter"
    )


RELAYOUTS = [("tp2", "tp1"), ("tp1", "tp2"), ("tp1", "pp2"), ("pp2", "ep2"), ("ep2", "tp2")]


@pytest.mark.parametrize(("saved", "layout"), RELAYOUTS, ids=[f"{a}-to-{b}" for a, b in RELAYOUTS])
def test_a_checkpoint_resumes_at_another_layout_with_the_same_logits_and_next_steps(
    impl, base, ckpt_root, saved, layout
):
    """Tolerance ``ULPS * eps(float32) * scale``; the smallest defect claimed is one target of one layer not
    restored (left at its fresh value): the adapter's effect on the logits at the checkpoint, shared over its
    (target, layer) pairs, must exceed the tolerance, measured in this run."""
    want = uninterrupted(impl, base, ckpt_root, saved)
    got = resumed(impl, base, ckpt_root, saved, layout)
    where = f"saved at {saved}, resumed at {layout}"
    assert all(g["resumed"]["rng_restored"] is False for g in got), f"{where}: generators restored at another layout"
    fresh, at_save = _last(want, "start_logits"), _last(want, "saved_logits")
    tolerance = ah.ulp_tolerance(torch.float32, ulps=ULPS, scale=ah.max_abs(at_save))
    pairs = 5 * get_preset(PRESET).num_hidden_layers
    ah.assert_effect_exceeds(ah.max_abs(at_save - fresh), tolerance, factor=pairs,
                             what=f"the adapter at step {SAVE_AT}, shared over {pairs} (target, layer) pairs",
                             context=where)  # fmt: skip
    ah.assert_close_ulps(_last(got, "start_logits"), at_save, dtype=torch.float32, ulps=ULPS,
                         name="logits right after the resume vs at the save", context=where)  # fmt: skip
    ah.assert_close_ulps(_last(got, "final_logits"), _last(want, "final_logits"), dtype=torch.float32, ulps=ULPS,
                         name=f"logits after step {STEPS}", context=where)  # fmt: skip
    for step, loss in got[-1]["losses"].items():
        ah.assert_close_ulps(torch.tensor(loss), torch.tensor(want[-1]["losses"][step]), dtype=torch.float32,
                             ulps=ULPS, name=f"loss of step {step}", context=where)  # fmt: skip


def _sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recertify(ckpt) -> None:
    """Rewrite ``.complete`` for the files as they now are (a checkpoint whose bytes are what its writer wrote)."""
    import json

    marker = json.loads((ckpt / ".complete").read_text())
    marker["files"] = {name: _sha256(ckpt / name) for name in marker["files"]}
    (ckpt / ".complete").write_text(json.dumps(marker))


def _edit_tensors(ckpt, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = edit(load_file(str(ckpt / "adapter.safetensors")))
    save_file(tensors, str(ckpt / "adapter.safetensors"), metadata={"format": "pt"})
    _recertify(ckpt)


def _edit_state(ckpt, edit) -> None:
    import json

    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _recertify(ckpt)


def _nan_first(tensors):
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    return tensors


def _torn(ckpt) -> None:
    """One bit of the optimizer state's last value changed (its lowest mantissa byte): still a readable file of
    finite numbers, so only the marker's hash tells."""
    data = bytearray((ckpt / "optimizer.safetensors").read_bytes())
    data[-4] ^= 1
    (ckpt / "optimizer.safetensors").write_bytes(bytes(data))


def _other_base(state):
    name = next(iter(state["base_fingerprint"]["tensors"]))
    state["base_fingerprint"]["tensors"][name]["sha256"] = "0" * 64


#: label -> (how the good checkpoint is spoiled, the file the refusal must name)
SPOILED = {
    "no-marker": (lambda c: (c / ".complete").unlink(), ".complete"),
    "torn-file": (_torn, "optimizer.safetensors"),
    "empty-adapter": (lambda c: _edit_tensors(c, lambda t: {}), "adapter.safetensors"),
    "nan-adapter": (lambda c: _edit_tensors(c, _nan_first), "adapter.safetensors"),
    "other-targets": (lambda c: _edit_tensors(c, lambda t: {n: v for n, v in t.items() if ".wo_a." not in n}),
                      "adapter.safetensors"),
    "other-rank": (lambda c: _edit_state(c, lambda s: s["lora"].update(r=8)), "trainer_state.json"),
    "other-base": (lambda c: _edit_state(c, _other_base), "trainer_state.json"),
}  # fmt: skip


def test_a_checkpoint_that_must_not_be_resumed_is_refused_on_every_rank_naming_its_file(impl, base, ckpt_root):
    """Interrupted (no ``.complete``), torn, empty, NaN, saved for other targets, another LoRA rank, another base,
    absent: each is refused on both TP ranks with the same typed error naming the file, and no LoRA parameter
    changes (never a silent fresh start)."""
    import shutil

    uninterrupted(impl, base, ckpt_root, "tp2")
    dirs = {}
    for label, (spoil, _) in SPOILED.items():
        dirs[label] = ckpt_root / f"spoiled-{label}"
        shutil.rmtree(dirs[label], ignore_errors=True)
        shutil.copytree(ckpt_root / "ckpt-tp2", dirs[label])
        spoil(dirs[label])
    dirs["absent"] = ckpt_root / "no-such-checkpoint"
    case = _case(impl, base, "tp2", refuse=tuple(str(d) for d in dirs.values()))
    got = _run(impl, case, "tp2")
    for rank, payload in enumerate(got):
        assert payload["changed"] == [], f"rank {rank}: a refused resume changed {payload['changed']}"
        for label, where in dirs.items():
            message = payload["refused"][str(where)]
            assert message is not None, f"rank {rank}: the {label} checkpoint was resumed"
            assert message == got[0]["refused"][str(where)], f"{label}: ranks 0 and {rank} raised different errors"
            assert message.startswith("TrainingCheckpointError: "), f"{label}: {message}"
            named = str(where / SPOILED[label][1]) if label in SPOILED else str(where)
            assert named in message, f"{label}: the error does not name {named}: {message}"


#: how the save fails -> (the LoopCase fields, what the error must say)
SAVE_FAILURES = {
    "nan-on-the-last-rank": ({"poison": True}, ("NaN", ".adapter.", "phase write")),
    "rank0-prepare": ({"save_fault": (0, "prepare")}, ("rank 0: OSError", "phase prepare")),
    "rank1-prepare": ({"save_fault": (1, "prepare")}, ("rank 1: OSError", "phase prepare")),
    "rank0-write-fsync": ({"save_fault": (0, "write")}, ("rank 0: OSError", "phase write")),
}


@pytest.mark.parametrize("failure", list(SAVE_FAILURES))
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_keeps_the_earlier_checkpoint(
    impl, base, ckpt_root, failure
):
    """A NaN LoRA parameter on the last rank, or the real call of a save phase failing on one rank (the optimizer
    read in ``prepare``, the writer's fsync in ``write``): every rank raises the same error naming the rank and the
    phase, and the checkpoint already at that path keeps its bytes, with nothing beside it."""
    import shutil

    uninterrupted(impl, base, ckpt_root, "tp2")
    fields, says = SAVE_FAILURES[failure]
    target = ckpt_root / f"failed-save-{failure}"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(ckpt_root / "ckpt-tp2", target)
    before = {f.name: _sha256(f) for f in target.iterdir()}
    got = _run(impl, _case(impl, base, "tp2", save_at=SAVE_AT, save_dir=str(target), **fields), "tp2")
    errors = [p.get("save_error") for p in got]
    assert all(e is not None and e == errors[0] for e in errors), f"{failure}: the ranks' save errors: {errors}"
    assert errors[0].startswith("TrainingCheckpointError: "), errors[0]
    assert all(s in errors[0] for s in says), f"{failure}: the error does not say {says}: {errors[0]}"
    assert {f.name: _sha256(f) for f in target.iterdir()} == before, f"{failure}: the earlier checkpoint changed"
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.")]
    assert not leftovers, f"{failure}: {leftovers} beside it"


def test_the_newest_complete_checkpoint_is_found_and_none_complete_is_an_error_not_a_fresh_start(
    impl, base, ckpt_root, tmp_path
):
    """Under one root: step 2's complete checkpoint and a newer one without ``.complete`` (killed while saving) ->
    step 2's; only the incomplete one -> TrainingCheckpointError naming it; nothing at all -> None (a fresh run)."""
    import shutil

    uninterrupted(impl, base, ckpt_root, "tp2")
    root = tmp_path / "checkpoints"
    shutil.copytree(ckpt_root / "ckpt-tp2", root / "step-000002")
    shutil.copytree(ckpt_root / "ckpt-tp2", root / "step-000004")
    _edit_state(root / "step-000004", lambda s: s.update(step=4))
    (root / "step-000004" / ".complete").unlink()
    assert impl.latest_training_checkpoint(root) == root / "step-000002"
    shutil.rmtree(root / "step-000002")
    with pytest.raises(impl.TrainingCheckpointError, match="none complete") as err:
        impl.latest_training_checkpoint(root)
    assert str(root / "step-000004") in str(err.value), err.value
    assert impl.latest_training_checkpoint(tmp_path / "nothing-here") is None


def test_a_checkpoint_written_by_another_rank_holds_the_same_files(impl, base, ckpt_root):
    """``writer_rank=1``: the checkpoint rank 1 writes is, file for file, the one rank 0 writes (every rank gathers
    the full tensors and every rank's generators), and rank 0 writes nothing beside it."""
    uninterrupted(impl, base, ckpt_root, "tp2")
    uninterrupted(impl, base, ckpt_root, "tp2", save_writer=1)
    by_rank0, by_rank1 = ckpt_root / "ckpt-tp2", ckpt_root / ckpt_name("tp2", save_writer=1)
    files = sorted(p.name for p in by_rank0.iterdir())
    assert sorted(p.name for p in by_rank1.iterdir()) == files, sorted(by_rank1.iterdir())
    for name in files:
        assert _sha256(by_rank1 / name) == _sha256(by_rank0 / name), f"{name}: differs when rank 1 writes it"
    assert not [p.name for p in ckpt_root.iterdir() if p.name.startswith(f".{by_rank1.name}.")], "leftovers"
    import json

    layout = json.loads((by_rank1 / "trainer_state.json").read_text())["layout"]
    assert layout == {"world": 2, "tp": 2, "pp": 1, "ep": 1}, f"the saved layout is {layout}"
    from safetensors.torch import load_file

    generators = load_file(str(by_rank1 / "rng.safetensors"))
    assert {"rank0/cpu", "rank1/cpu"} <= set(generators), f"not every rank's generators: {sorted(generators)}"
    adapter, optimizer = (load_file(str(by_rank1 / f)) for f in ("adapter.safetensors", "optimizer.safetensors"))
    for name, t in optimizer.items():
        full = adapter[name.split("/", 1)[1]]
        assert t.shape in (full.shape, ()), f"{name}: shape {list(t.shape)}, not the full {list(full.shape)}"

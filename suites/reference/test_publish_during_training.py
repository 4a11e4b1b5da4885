"""Publishing to rollout from a training run, on every rank: ``AdapterPublisher.publish_model``
after each Adam step of a real native run (``fixtures.ranks.loop_rank_fns``), and one rank's failure during a
publication. The single-process publisher's contract (versions, copies, checksums, vLLM's in-memory load) is
``suites/reference/test_publish_every_step.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from fixtures.data.adapter_states import sglang_checksum, step_in_place

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("publish-training")]


TRAINING_RUNS = {
    "tp2-fp32": ("tp2", {}),
    "pp2-bf16-fp32-masters": ("pp2", {"dtype": "bfloat16", "optimizer": "masters"}),
}


@pytest.fixture(scope="module")
def loop_base(tiny_ckpt_factory) -> str:
    from fixtures.ranks.loop_rank_fns import BASE_SEED, PRESET

    return str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))


@pytest.mark.parametrize("run", list(TRAINING_RUNS))
def test_every_step_of_a_training_run_publishes_that_steps_adapter_on_every_rank(impl, loop_base, run):
    """``publish_model`` after each of 4 Adam steps (TP=2 fp32; PP=2 bf16 on fp32 masters): version k is published
    at step k, every rank agrees on the version, the published bytes are the adapter's at that step (sha256 of
    each tensor, computed by the rank, against the gathered native adapter's), SGLang-form checksums match them,
    later steps leave every version as it was, and no published tensor shares storage with a live parameter."""
    from fixtures.ranks.loop_rank_fns import STEPS, loop_case, run_loop

    layout, kw = TRAINING_RUNS[run]
    got = run_loop(impl.name, loop_case(impl.name, loop_base, layout, publish_every=1, **kw), layout)
    assert [p["publications"]["version"] for p in got] == [STEPS] * len(got), "the ranks' versions differ"
    pubs = got[0]["publications"]
    assert sorted(pubs["at_publish"]) == list(range(1, STEPS + 1)), f"{run}: versions {sorted(pubs['at_publish'])}"
    for version, at in pubs["at_publish"].items():
        where = f"{run} version {version}"
        assert at["step"] == version and at["version_everywhere"] == version, f"{where}: published at step {at['step']}"
        assert at["expected_checksums"] == at["sums"], f"{where}: expected_checksums are not the tensors' sha256"
        assert sorted(at["sums"].values()) == at["adapter_sums"], f"{where}: not the adapter's bytes at its step"
        assert pubs["at_end"][version] == at["sums"], f"{where}: changed by a later step"
    assert pubs["aliased"] == [], f"{run}: published tensors alias live parameters: {pubs['aliased'][:4]}"
    assert len({tuple(sorted(a["sums"].items())) for a in pubs["at_publish"].values()}) == STEPS, "two versions alike"


@pytest.mark.parametrize("rank", [0, 1], ids=["writer", "peer"])
def test_a_publication_failing_on_one_rank_fails_on_every_rank_and_the_previous_version_stays(impl, loop_base, rank):
    """A NaN in one rank's shard (the writer's, or its peer's) before the third publication: every rank raises the
    same PublicationError, naming that rank and the tensor, well within the 30 s timeout; every rank stays at
    version 2, and the writer's current publication is still version 2."""
    from fixtures.ranks.loop_rank_fns import loop_case, run_loop

    case = loop_case(impl.name, loop_base, "tp2", publish_every=1, poison_publish_at=3, poison_rank=rank)
    got = run_loop(impl.name, case, "tp2")
    errors = [p["publications"]["error"] for p in got]
    assert all(e is not None for e in errors), f"a rank published the poisoned step: {errors}"
    assert len({e["message"] for e in errors}) == 1, f"the ranks raised different errors: {errors}"
    message = errors[0]["message"]
    assert message.startswith("PublicationError: ") and f"rank {rank}: NonFiniteAdapterError" in message, message
    assert ".adapter." in message and "version 2 stays current" in message, message
    assert all(e["seconds"] < 10 for e in errors), f"a rank took {max(e['seconds'] for e in errors):.1f} s to report"
    assert [e["version"] for e in errors] == [2] * len(got) and got[0]["publications"]["current"] == 2, errors


def test_a_publication_to_another_writer_rank_is_held_there_and_every_rank_agrees_on_the_version(impl, loop_base):
    """``writer_rank=1``: rank 1 gets each version (the adapter's bytes at its step) and becomes its holder; rank 0
    gets None and holds nothing, yet counts the same versions."""
    from fixtures.ranks.loop_rank_fns import STEPS, loop_case, run_loop

    got = run_loop(impl.name, loop_case(impl.name, loop_base, "tp2", publish_every=1, publish_writer=1), "tp2")
    writer, peer = got[1]["publications"], got[0]["publications"]
    assert writer["version"] == peer["version"] == STEPS, (writer["version"], peer["version"])
    assert peer["at_publish"] == {} and peer["current"] is None, "rank 0 received a publication it does not write"
    assert sorted(writer["at_publish"]) == list(range(1, STEPS + 1)) and writer["current"] == STEPS, writer["current"]
    for version, at in writer["at_publish"].items():
        assert sorted(at["sums"].values()) == at["adapter_sums"], f"version {version}: not the adapter at its step"


# One rank, in this process: the collective form at world size 1 (megatron, so not in the pin-independent file).
R, ALPHA = 4, 8.0


def _one_rank_lora_model(impl):
    """A native V4 model with LoRA on every main-attention target, in this process (a world of one rank)."""
    from fixtures.data.native_weights import ensure_single_rank_megatron

    ensure_single_rank_megatron(impl)
    return _lora_model(impl)


def _lora_model(impl):
    """The native V4 model with LoRA on every main-attention target, the same on every rank that builds it (Megatron's
    parallel state already set up)."""
    from tiny_models.presets import get_preset

    torch.manual_seed(7)
    model = impl.DeepseekV4NativeModel(impl.V4Config.from_hf(get_preset("tiny-mixed")), include_mtp=False)
    handle = impl.apply_lora([model], targets=["wq_a", "wkv", "wo_b"], rank=R, alpha=ALPHA)
    with torch.no_grad():  # B starts at zero: make every LoRA tensor distinct, as after a step
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    return model, handle


def test_publish_model_on_one_rank_publishes_the_gathered_adapter_as_the_next_version(impl):
    """The collective form at world size 1 (the writer is this rank): each call takes the next version, returns
    it and makes it current; it holds the gathered adapter's bytes at that step, owned and checksummed."""
    model, handle = _one_rank_lora_model(impl)
    publisher = impl.AdapterPublisher()
    for k in range(1, 3):
        want = impl.publish_in_memory(impl.gather_adapter_state([model], handle))[0]
        pub = publisher.publish_model([model], handle, timeout_s=30)
        assert pub is not None, f"publish_model returned None on the writer rank (version {k})"
        assert pub.version == k == publisher.version and publisher.current is pub, (pub.version, publisher.version)
        assert sorted(pub.tensors) == sorted(want), f"version {k}: not the gathered adapter's tensors"
        for name, t in pub.tensors.items():
            assert torch.equal(t, want[name]), f"version {k} {name}: not the adapter at its step"
        assert pub.expected_checksums == {n: sglang_checksum(t) for n, t in want.items()}, f"version {k}"
        step_in_place({n: p for n, p in model.named_parameters() if p.requires_grad}, k)


def test_publish_model_refuses_a_nan_shard_naming_the_rank_and_keeps_the_previous_version(impl):
    model, handle = _one_rank_lora_model(impl)
    publisher = impl.AdapterPublisher()
    first = publisher.publish_model([model], handle, timeout_s=30)
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(impl.PublicationError) as err:
        publisher.publish_model([model], handle, timeout_s=30)
    message = str(err.value)
    assert "phase check" in message and "rank 0: NonFiniteAdapterError" in message, message
    assert "version 2 failed" in message and "version 1 stays current" in message, message
    assert publisher.version == 1 and publisher.current is first, "a refused publication changed the current version"


# Two data-parallel ranks, each with the whole (tiny) model: how every rank learns of a failure anywhere.
#: the exchange timeout of the late-rank case, and how long after its peer that rank calls publish_model
LATE_TIMEOUT_S, LATE_BY_S = 2.0, 5.0


@dataclass(frozen=True)
class ReplicaCase:
    impl: str


def _rank_publish_failures(rank: int, world_size: int, case: ReplicaCase) -> dict:
    """A NaN in the same tensor of every replica, then rank 1 calling publish_model after its peer's deadline: what
    each rank raised, and its version afterwards."""
    import torch.distributed as dist

    from fixtures.runner.impl_loader import load_impl
    from fixtures.runner.multirank import init_megatron_parallel

    impl = load_impl(case.impl)
    init_megatron_parallel()
    model, handle = _lora_model(impl)
    publisher = impl.AdapterPublisher()
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    seen: dict[str, str | None] = {}

    def attempt(label: str, timeout_s: float, late_s: float = 0.0) -> None:
        time.sleep(late_s)
        seen[label] = None
        try:
            publisher.publish_model([model], handle, timeout_s=timeout_s)
        except impl.PublicationError as err:
            seen[label] = str(err)
        dist.barrier()  # the group must still work

    kept = param.detach().clone()
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    attempt("nan-everywhere", 30.0)
    with torch.no_grad():
        param.copy_(kept)
    attempt("late-rank", LATE_TIMEOUT_S, LATE_BY_S if rank == 1 else 0.0)
    return {"seen": seen, "version": publisher.version}


def test_every_rank_failing_alike_is_named_once_and_a_late_rank_learns_its_peer_gave_up(impl):
    """Two replicas with a NaN in the same tensor: both ranks raise the same PublicationError, which names both ranks
    together with the one reason. Then rank 1 calls publish_model after rank 0's deadline: rank 0 names it dead or
    hung, and rank 1, which finds every status ok, raises that its peer aborted the publication instead of
    publishing alone. Neither rank advances its version."""
    from fixtures.runner.multirank import impl_preload, run_ranks

    results = run_ranks(_rank_publish_failures, ReplicaCase(impl.name), nproc=2, timeout_s=90,
                        preload=impl_preload(impl.name))  # fmt: skip
    seen = [r.payload["seen"] for r in results]
    errors = [s["nan-everywhere"] for s in seen]
    assert errors[0] is not None and errors[0] == errors[1], f"the ranks raised {errors}"
    said = errors[0]
    assert "failed in phase check: ranks 0, 1: NonFiniteAdapterError: " in said, said
    assert said.count("holds NaN or Inf") == 1, f"the shared reason is not said once: {said}"

    waited, late = (s["late-rank"] or "" for s in seen)
    assert f"rank 1: no response within {LATE_TIMEOUT_S:g}s in phase check (dead or hung)" in waited, waited
    assert "failed in phase check: publication aborted by a peer that timed out before phase check. " in late, late
    versions = [r.payload["version"] for r in results]
    assert versions == [0, 0], f"a failed publication advanced the ranks' versions to {versions}"

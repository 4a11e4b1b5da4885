"""Publishing to rollout every step (Miles' colocated path: whole adapter in memory, fixed name, ``weight_version``).

Between publications the live LoRA tensors change in place, as an optimizer step changes them. Each version must
equal the adapter at its step bit for bit, stay so after later steps (it shares no storage with the live tensors),
carry per-tensor sha256 in the form SGLang's ``load_lora_adapter_from_tensors`` checks (``expected_checksums``:
name -> sha256 hex of the tensor's contiguous bytes, derived here the way SGLang's ``tp_worker`` computes it), and
a refused state publishes nothing: the version and the current publication stay.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from fixtures.adapter_states import make_native_adapter

pytestmark = pytest.mark.cpu

SHAPES = {"wq_a": (48, 64), "wkv": (32, 64), "wo_b": (64, 32)}
LAYERS, R, ALPHA, STEPS = 2, 4, 8.0, 5


def _sglang_checksum(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def _step(live: dict[str, torch.Tensor], k: int) -> None:
    """An optimizer step: every tensor changed in place."""
    with torch.no_grad():
        for i, t in enumerate(live.values()):
            t.add_(torch.full_like(t, 1e-3 * (k + 1) * (i % 3 + 1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_step_is_a_new_version_equal_to_the_adapter_at_that_step(impl, dtype):
    live = make_native_adapter(SHAPES, LAYERS, R, seed=3, dtype=dtype)
    publisher = impl.AdapterPublisher()
    published, frozen = [], []
    for k in range(STEPS):
        pub = publisher.publish(impl.AdapterState(live, r=R, alpha=ALPHA))
        assert pub.version == k + 1 == publisher.version, (pub.version, k)
        published.append(pub)
        frozen.append(
            impl.publish_in_memory(impl.AdapterState({n: t.clone() for n, t in live.items()}, r=R, alpha=ALPHA))[0]
        )
        _step(live, k)
    live_storage = {t.untyped_storage().data_ptr() for t in live.values()}
    for k, (pub, want) in enumerate(zip(published, frozen, strict=True)):
        assert sorted(pub.tensors) == sorted(want), f"version {pub.version}: names differ"
        for name, t in pub.tensors.items():
            assert t.dtype == dtype, f"version {pub.version} {name}: dtype {t.dtype}"
            assert torch.equal(t, want[name]), f"version {pub.version} {name}: not the adapter at step {k}"
            assert t.untyped_storage().data_ptr() not in live_storage, (
                f"version {pub.version} {name} aliases a live tensor"
            )
        assert pub.expected_checksums == {n: _sglang_checksum(t) for n, t in want.items()}, f"version {pub.version}"
    assert len({tuple(sorted(p.expected_checksums.items())) for p in published}) == STEPS, "two versions hash alike"


def test_a_refused_state_publishes_nothing_and_the_previous_version_stays(impl):
    live = make_native_adapter(SHAPES, LAYERS, R, seed=4)
    publisher = impl.AdapterPublisher()
    first = publisher.publish(impl.AdapterState(live, r=R, alpha=ALPHA))
    name = next(iter(live))
    live[name][0, 0] = float("nan")
    with pytest.raises(impl.NonFiniteAdapterError) as err:
        publisher.publish(impl.AdapterState(live, r=R, alpha=ALPHA))
    assert name in str(err.value), f"the error does not name the tensor {name}: {err.value}"
    assert publisher.version == 1 and publisher.current is first, "a refused state changed the current version"
    assert all(torch.isfinite(t).all() for t in first.tensors.values()), "the published version saw the NaN"


@pytest.mark.xdist_group("consumers")
@pytest.mark.consumer_env
def test_vllm_loads_every_version_from_its_tensors(impl, tmp_path):
    """vLLM 0.33's own in-memory entry point (``LoRAModel.from_lora_tensors``, with the V4 model's weights mapper
    and skip prefixes; ``fixtures/consumers/probe_vllm_tensors.py`` in the vLLM environment) builds every module of
    every version, holding exactly the published bytes and scaling alpha/r."""
    import json

    from safetensors.torch import save_file

    from fixtures.consumers import HERE, require_consumer_env, run_probe_script

    require_consumer_env("vllm")
    live = make_native_adapter(SHAPES, LAYERS, R, seed=6)
    publisher, plan, sums = impl.AdapterPublisher(dialect="official"), [], {}
    for k in range(3):
        pub = publisher.publish(impl.AdapterState(live, r=R, alpha=ALPHA))
        save_file(pub.tensors, str(tmp_path / f"v{pub.version}.safetensors"))
        sums[pub.version] = pub.expected_checksums
        plan.append(
            {"version": pub.version, "tensors": str(tmp_path / f"v{pub.version}.safetensors"), "config": pub.config}
        )
        _step(live, k)
    (tmp_path / "plan.json").write_text(json.dumps({"versions": plan}))
    run_probe_script(
        "vllm",
        HERE / "probe_vllm_tensors.py",
        ["--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "r.json")],
        timeout_s=300,
    )
    got = json.loads((tmp_path / "r.json").read_text())["versions"]
    assert sorted(got, key=int) == [str(e["version"]) for e in plan], sorted(got)
    for entry in plan:
        modules = got[str(entry["version"])]["modules"]
        assert len(modules) == LAYERS * len(SHAPES), f"version {entry['version']}: vLLM built {sorted(modules)}"
        for module, held in modules.items():
            stem = "base_model.model." + module.removeprefix("model.")
            for half, key in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
                assert held[key] == sums[entry["version"]][f"{stem}.{half}.weight"], (
                    f"v{entry['version']} {module}.{half}"
                )
            assert held["scaling"] == ALPHA / R, f"{module}: scaling {held['scaling']}"


# ------------------------------------------------------------------ during a real training run, on every rank

TRAINING_RUNS = {
    "tp2-fp32": ("tp2", {}),
    "pp2-bf16-fp32-masters": ("pp2", {"dtype": "bfloat16", "optimizer": "masters"}),
}


@pytest.fixture(scope="module")
def loop_base(tiny_ckpt_factory) -> str:
    from fixtures.loop_rank_fns import BASE_SEED, PRESET

    return str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))


@pytest.mark.multirank
@pytest.mark.xdist_group("training-loop")
@pytest.mark.parametrize("run", list(TRAINING_RUNS))
def test_every_step_of_a_training_run_publishes_that_steps_adapter_on_every_rank(impl, loop_base, run):
    """``publish_model`` after each of 4 Adam steps (TP=2 fp32; PP=2 bf16 on fp32 masters): version k is published
    at step k, every rank agrees on the version, the published bytes are the adapter's at that step (sha256 of
    each tensor, computed by the rank, against the gathered native adapter's), SGLang-form checksums match them,
    later steps leave every version as it was, and no published tensor shares storage with a live parameter."""
    from fixtures.loop_rank_fns import STEPS, loop_case, run_loop

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


@pytest.mark.multirank
@pytest.mark.xdist_group("training-loop")
def test_a_publication_failing_on_one_rank_fails_on_every_rank_and_the_previous_version_stays(impl, loop_base):
    """A NaN in the last rank's shard before the third publication: every rank raises the same PublicationError,
    naming that rank and the tensor, well within the 30 s timeout; every rank stays at version 2, and the writer's
    current publication is still version 2."""
    from fixtures.loop_rank_fns import loop_case, run_loop

    got = run_loop(impl.name, loop_case(impl.name, loop_base, "tp2", publish_every=1, poison_publish_at=3), "tp2")
    errors = [p["publications"]["error"] for p in got]
    assert all(e is not None for e in errors), f"a rank published the poisoned step: {errors}"
    assert len({e["message"] for e in errors}) == 1, f"the ranks raised different errors: {errors}"
    message = errors[0]["message"]
    assert message.startswith("PublicationError: ") and "rank 1: NonFiniteAdapterError" in message, message
    assert ".adapter." in message and "version 2 stays current" in message, message
    assert all(e["seconds"] < 10 for e in errors), f"a rank took {max(e['seconds'] for e in errors):.1f} s to report"
    assert [e["version"] for e in errors] == [2] * len(got) and got[0]["publications"]["current"] == 2, errors

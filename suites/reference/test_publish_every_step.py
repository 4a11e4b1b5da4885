"""Publishing to rollout every step (Miles' colocated path: whole adapter in memory, fixed name, ``weight_version``).

Between publications the live LoRA tensors change in place, as an optimizer step changes them. Each version must
equal the adapter at its step bit for bit, stay so after later steps (it shares no storage with the live tensors),
carry per-tensor sha256 in the form SGLang's ``load_lora_adapter_from_tensors`` checks (``expected_checksums``:
name -> sha256 hex of the tensor's contiguous bytes, derived here the way SGLang's ``tp_worker`` computes it), and
a refused state publishes nothing: the version and the current publication stay.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.data.adapter_states import make_native_adapter, sglang_checksum, step_in_place

pytestmark = pytest.mark.cpu

SHAPES = {"wq_a": (48, 64), "wkv": (32, 64), "wo_b": (64, 32)}
LAYERS, R, ALPHA, STEPS = 2, 4, 8.0, 5


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
        step_in_place(live, k)
    live_storage = {t.untyped_storage().data_ptr() for t in live.values()}
    for k, (pub, want) in enumerate(zip(published, frozen, strict=True)):
        assert sorted(pub.tensors) == sorted(want), f"version {pub.version}: names differ"
        for name, t in pub.tensors.items():
            assert t.dtype == dtype, f"version {pub.version} {name}: dtype {t.dtype}"
            assert torch.equal(t, want[name]), f"version {pub.version} {name}: not the adapter at step {k}"
            assert t.untyped_storage().data_ptr() not in live_storage, (
                f"version {pub.version} {name} aliases a live tensor"
            )
        assert pub.expected_checksums == {n: sglang_checksum(t) for n, t in want.items()}, f"version {pub.version}"
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
        step_in_place(live, k)
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

"""The serving engine's own math: vLLM applies our adapters on a CPU host, number for number against PEFT.

vLLM's own layer classes (the LoRA wrappers ``LRUCacheWorkerLoRAManager`` puts around the model's projections)
and its punica CPU ops (``PunicaWrapperCPU`` over ``vllm/lora/ops/torch_ops``) compute every target's projection
at the model's own call sites (``fixtures/consumers/probe_vllm_numerics.py``, in the vLLM environment) on
adapters the implementation exported in the ``official`` dialect, directly and re-published by
``dsv4-lora export --consumer vllm``, and on a third party's adapter (stock PEFT's ``save_pretrained``)
re-published the same way; PEFT on transformers computes the same projections with the transformers-naming
files of the same adapters (``fixtures/consumers/numerics.py``). Five adapters are active at once in five slots
(ranks 4, 5 and 6, vLLM padding all to 8) and the tokens alternate between them and no adapter, on the prefill
(sgmv) and decode (bgmv) paths, in fp32 and bf16. The tolerances are derived in
``numerics.py`` (``ULPS_FP32``, ``ULPS_BF16``); every comparison also asserts the LoRA effect is far above its
tolerance in the same run.

Each vLLM release runs in its own lane (``fixtures.consumers.VLLM_LANES``): its own LoRA classes make its numbers
(0.34's ``DeepseekV4GroupedWoAWithLoRA`` for wo_a, reached through the attention's own ``_o_proj``). Which targets a
release applies is impl's table (``impl.consumer_rule``), itself checked against that release's code by
``suites/reference/test_consumers.py``: applied targets must match PEFT; for ``loaded_not_applied`` ones the fraction of
PEFT's delta vLLM's output carries is measured and must stay about 0 (1 means vLLM now applies it: the table
must change). Stand-ins: only where a kernel cannot run on a CPU host, named in
``fixtures/consumers/stand_ins.py`` (``KERNEL_STAND_INS``) and in the probe's report; a host adaptation
(``HOST_CHECKS``) only where the release refuses the host, reported by the probe and recorded here.
"""

from __future__ import annotations

import pytest

from fixtures.asserts import assert_effect_exceeds
from fixtures.consumers import VLLM_LANES, require_consumer_env
from fixtures.consumers import golden_numerics as gn
from fixtures.consumers import numerics as nm
from fixtures.consumers.stand_ins import HOST_ADAPTATIONS, HOST_CHECKS

pytestmark = [pytest.mark.cpu, pytest.mark.consumer_env, pytest.mark.xdist_group("consumers")]

#: |fraction| below this: vLLM's output holds none of the delta beyond bf16 noise; above 1 - this: all of it
FRACTION_SLACK = 0.05
#: the LoRA class each release's manager installs around wo_a (the others are the generic linear ones)
WO_A_WRAPPER = {"0.33.0": "ColumnParallelLinearWithLoRA", "0.34.0": "DeepseekV4GroupedWoAWithLoRA"}


@pytest.fixture(scope="module", params=VLLM_LANES)
def measured(impl, tmp_path_factory, request) -> nm.Numerics:
    require_consumer_env(request.param)
    return nm.measured_once(impl, tmp_path_factory, request.param)


def _variants(measured: nm.Numerics) -> list[str]:
    got = [v for v, rec in measured.report["variants"].items() if rec.get("importable")]
    assert "nvidia" in got, f"vLLM's NVIDIA model did not import: {measured.report['variants']}"
    return got


def _status(impl, measured, variant: str, target: str) -> str:
    rule = impl.consumer_rule(f"vllm/{variant}", measured.report["version"], "official", target)
    assert rule is not None, f"impl holds no rule for vllm/{variant} {measured.report['version']} official {target}"
    return str(rule.status)


def test_vllm_runs_its_own_cpu_lora_stack(measured):
    report = measured.report
    release = report["version"]
    assert report["platform"] == "CpuPlatform", f"vLLM {release}: {report['platform']}"
    for variant in _variants(measured):
        rec = report["variants"][variant]
        assert rec["punica"] == ["vllm/lora/punica_wrapper/punica_cpu.py:PunicaWrapperCPU"], rec["punica"]
        wrappers = {k: v.rsplit(":", 1)[1] for k, v in rec["lora_classes"].items()}
        assert wrappers == {
            "fused_wqa_wkv": "MergedColumnParallelLinearWithLoRA",
            "wq_b": "ColumnParallelLinearWithLoRA",
            "wo_a": WO_A_WRAPPER[release],
            "wo_b": "RowParallelLinearWithLoRA",
        }, f"vLLM {release} {variant}: {wrappers}"
        assert rec["loaded"] == sorted(s for s, *_ in nm.ADAPTERS), rec["loaded"]
    assert set(report["kernel_stand_ins"]) == {
        "torch.cuda.Event",
        "fused_inv_rope_fp8_quant",
        "compute_fp8_einsum_recipe",
    }


def test_host_adaptations_are_the_named_ones_and_only_where_the_release_refuses(measured, record_property):
    """Every adaptation the probe used is one stand_ins.py names; a waived start-up check only where the release
    refused this host and the package it asks for is really absent (never where the real thing works)."""
    report = measured.report
    used = report["host_adaptations"]
    record_property(f"vllm_{report['version']}_host_adaptations", used)
    named = [*HOST_ADAPTATIONS, *HOST_CHECKS]
    unnamed = [u for u in used if not any(u.startswith(n) for n in named)]
    assert not unnamed, f"vLLM {report['version']}: adaptations stand_ins.py does not name: {unnamed}"
    waived = [u for u in used if any(u.startswith(n) for n in HOST_CHECKS)]
    assert not (waived and report["has_triton"]), f"vLLM {report['version']}: waived with Triton present: {waived}"
    assert all(": refused (" in w for w in waived), f"vLLM {report['version']}: a check waived unrefused: {waived}"


@pytest.mark.parametrize("dtype", nm.DTYPES)
@pytest.mark.parametrize("mode", nm.MODES)
def test_every_applied_target_equals_peft(impl, measured, mode, dtype, record_property):
    """Every target the release applies (the table's word, itself the release's code's) equals PEFT, wherever the
    probe measured it (wo_a: bf16, the o-projection's unquantized branch writing a bf16 buffer)."""
    checked, wrong = [], []
    release = measured.report["version"]
    for variant in _variants(measured):
        for target in (t for t in nm.TRANSFORMERS_LEAF if _status(impl, measured, variant, t) == "applied"):
            if f"{variant}/{dtype}/{mode}/layers.0.{target}" not in measured.vllm:
                continue
            f = nm.figure(measured, variant, target, dtype, mode)
            checked.append(f.__dict__)
            context = f"vllm/{variant} {release} {target} {mode} {dtype}"
            if f.worst_ratio > 1.0:
                wrong.append(f"{context}: max |Δ| {f.max_delta:.3e} is {f.worst_ratio:.2f} x the tolerance")
            assert_effect_exceeds(
                f.min_effect_ratio, 1.0, factor=nm.EFFECT_FACTOR, what=f"the LoRA delta of {target}", context=context
            )
    record_property("figures", checked)
    assert checked, "no target to check: impl says vLLM applies none"
    assert not wrong, "vLLM's output differs from PEFT's:\n" + "\n".join(wrong)


@pytest.mark.parametrize("mode", nm.MODES)
def test_wo_a_fraction_vllm_applies_follows_the_table(impl, measured, mode, record_property):
    """wo_a through the NVIDIA attention's own ``_o_proj`` (0.33 hands ``wo_a.weight`` to ``deep_gemm_fp8_o_proj``;
    0.34 calls the LoRA class's ``grouped_forward``), with the inverse-RoPE Triton step replaced by the identity at
    position 0 (stand_ins.inverse_rope_at_position_zero) and wo_b by the identity, in bf16 (the unquantized branch
    writes a bf16 buffer): the fraction of PEFT's delta must be the table's 0 or 1."""
    status = _status(impl, measured, "nvidia", "wo_a")
    release = measured.report["version"]
    fraction = nm.applied_fraction(measured, "nvidia", "wo_a", "bfloat16", mode)
    record_property(f"vllm_{release}_wo_a_fraction", fraction)
    if status == "loaded_not_applied":
        assert abs(fraction) < FRACTION_SLACK, (
            f"vLLM {release} now applies {fraction:.1%} of wo_a's LoRA delta: impl.CONSUMER_RULES (and the matrix) "
            "must say applied"
        )
    else:
        assert status == "applied", f"vLLM {release} wo_a: {status}"
        assert abs(fraction - 1) < FRACTION_SLACK, (
            f"impl says vLLM {release} applies wo_a, its output carries {fraction:.1%} of the delta"
        )


@pytest.mark.parametrize("dtype", nm.DTYPES)
def test_vllm_reproduces_the_golden_vectors_of_what_it_applies(impl, measured, dtype, record_property):
    """vLLM's own LoRA stack on the golden files an engine's CI would use (``golden/v1/``: its base, its ``official``
    adapters one target per slot, its inputs, loaded by the probe itself): on every token of both paths, every
    target the release applies gives the expected vector within the golden README's rule; one it does not apply
    keeps the base vector and misses the adapted one (strict: a release that starts applying it fails here, and the
    table and the matrix must change). In the same run, at every adapted token the adapted and base vectors lie
    more than twice the tolerance apart, so dropping the adapter at any one token is caught."""
    release, checked, wrong = measured.report["version"], [], []
    for variant in _variants(measured):
        for mode in nm.MODES:
            for target in gn.TARGETS:
                c = gn.check(measured.vllm, f"{variant}/{dtype}/{mode}", target, dtype)
                if c is None:  # wo_a: the o-projection runs here in bf16 on the NVIDIA path only
                    continue
                checked.append({"variant": variant, "mode": mode, **c.__dict__})
                context = f"vllm/{variant} {release} {target} {mode} {dtype}"
                assert_effect_exceeds(c.least_effect, 1.0, factor=2.0, what=f"{target}'s adapter", context=context)
                if _status(impl, measured, variant, target) == "applied":
                    if c.worst_vs_expected > 1.0:
                        wrong.append(f"{context}: {c.worst_vs_expected:.2f} x the golden tolerance")
                elif c.worst_adapted_vs_base > 1.0 or c.worst_vs_expected <= 1.0:
                    wrong.append(
                        f"{context}: the table says not applied, yet the output is {c.worst_adapted_vs_base:.2f} x "
                        f"the tolerance from the base vector and {c.worst_vs_expected:.2f} x from the adapted one"
                    )
    record_property("golden", checked)
    assert checked, "the probe measured no golden vector"
    assert not wrong, "vLLM against golden/v1:\n" + "\n".join(wrong)

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

Which targets vLLM applies is impl's table (``impl.consumer_rule``), itself checked against vLLM's code by
``suites/reference/test_consumers.py``: applied targets must match PEFT; for ``loaded_not_applied`` ones the fraction of
PEFT's delta vLLM's output carries is measured and must stay about 0 (1 means vLLM now applies it: the table
must change). Stand-ins: only where a kernel cannot run on a CPU host, named in
``fixtures/consumers/stand_ins.py`` (``KERNEL_STAND_INS``) and in the probe's report.
"""

from __future__ import annotations

import pytest

from fixtures.asserts import assert_effect_exceeds
from fixtures.consumers import numerics as nm
from fixtures.consumers import require_consumer_env

pytestmark = [pytest.mark.cpu, pytest.mark.consumer_env, pytest.mark.xdist_group("consumers")]

APPLIED_TARGETS = ("wq_a", "wq_b", "wkv", "wo_b")
#: |fraction| below this: vLLM's output holds none of the delta beyond bf16 noise; above 1 - this: all of it
FRACTION_SLACK = 0.05


@pytest.fixture(scope="module")
def measured(impl, tmp_path_factory) -> nm.Numerics:
    require_consumer_env("vllm")
    return nm.measured_once(impl, tmp_path_factory)


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
    assert report["platform"] == "CpuPlatform", report["platform"]
    for variant in _variants(measured):
        rec = report["variants"][variant]
        assert rec["punica"] == ["vllm/lora/punica_wrapper/punica_cpu.py:PunicaWrapperCPU"], rec["punica"]
        wrappers = {k: v.rsplit(":", 1)[1] for k, v in rec["lora_classes"].items()}
        assert wrappers == {
            "fused_wqa_wkv": "MergedColumnParallelLinearWithLoRA",
            "wq_b": "ColumnParallelLinearWithLoRA",
            "wo_a": "ColumnParallelLinearWithLoRA",
            "wo_b": "RowParallelLinearWithLoRA",
        }, wrappers
        assert rec["loaded"] == sorted(s for s, *_ in nm.ADAPTERS), rec["loaded"]
    assert set(report["kernel_stand_ins"]) == {"torch.cuda.Event", "fused_inv_rope_fp8_quant"}


@pytest.mark.parametrize("dtype", nm.DTYPES)
@pytest.mark.parametrize("mode", nm.MODES)
def test_every_applied_target_equals_peft(impl, measured, mode, dtype, record_property):
    checked, wrong = [], []
    for variant in _variants(measured):
        for target in (t for t in APPLIED_TARGETS if _status(impl, measured, variant, t) == "applied"):
            f = nm.figure(measured, variant, target, dtype, mode)
            checked.append(f.__dict__)
            context = f"vllm/{variant} {target} {mode} {dtype}"
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
    """vLLM's o-projection hands ``wo_a.weight`` to its kernel; measured with the inverse-RoPE Triton step replaced
    by the identity at position 0 (stand_ins.inverse_rope_at_position_zero) and wo_b by the identity, in bf16
    (the function's unquantized branch writes a bf16 buffer)."""
    status = _status(impl, measured, "nvidia", "wo_a")
    fraction = nm.applied_fraction(measured, "nvidia", "wo_a", "bfloat16", mode)
    record_property("wo_a_fraction", fraction)
    if status == "loaded_not_applied":
        assert abs(fraction) < FRACTION_SLACK, (
            f"vLLM now applies {fraction:.1%} of wo_a's LoRA delta: impl.CONSUMER_RULES (and the matrix) must "
            "say applied"
        )
    else:
        assert status == "applied", status
        assert abs(fraction - 1) < FRACTION_SLACK, f"impl says applied, vLLM applies {fraction:.1%} of the delta"

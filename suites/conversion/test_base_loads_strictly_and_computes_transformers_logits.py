"""The published base loads strictly and computes what transformers computes, at every layout.

A clean load places every checkpoint tensor and fills every parameter; a base with a tensor missing or one too many
is refused or reported, naming each offender by its checkpoint name. Without an adapter the logits equal those of
transformers' ``DeepseekV4ForCausalLM`` of the same base, within the judge's float32 rule, which is held below the
effect of one layer's attention output projection, measured in the same run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_conformance.driver import Layout
from dsv4_conformance.judge.oracle import LOGIT_RULE, base_model, least_layer_effect, max_abs
from fixtures.conformance.programs import BadBaseCase, DriverCase, build_and_logits, build_bad_bases, fixed_batch

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.needs("build", "load_report", "logits")]

LAYOUTS = {"dp": Layout(), "tp2": Layout(tp=2), "ep2": Layout(ep=2), "pp2": Layout(pp=2)}
#: the tensors the bad bases lose or gain
DROPPED = "layers.1.attn.wq_b.weight"
ADDED = "layers.1.attn.wq_c.weight"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_base_loads_cleanly_and_its_logits_are_transformers(drive, driver_name, conformance_base, layout):
    case = DriverCase(driver_name, str(conformance_base), LAYOUTS[layout])
    payloads = drive(build_and_logits, case)
    for rank, payload in enumerate(payloads):
        report = payload["report"]
        assert report.clean, f"{layout}, rank {rank}: {report}"
    import torch

    assert payloads[0]["logits"] is not None, f"{layout}: rank 0 returned no logits"
    got = torch.from_numpy(payloads[0]["logits"])
    ids, _ = fixed_batch(str(conformance_base), case.seed)
    oracle = base_model(conformance_base)

    with torch.no_grad():
        want = oracle(ids).logits.float()
    assert tuple(got.shape) == tuple(want.shape), (
        f"{layout}: logits {tuple(got.shape)}, transformers {tuple(want.shape)}"
    )
    tolerance = LOGIT_RULE.tolerance(want)
    power = least_layer_effect(oracle, ids)
    assert power.exceeds(tolerance), f"the tolerance {tolerance:.2e} hides {power.module} ({power.effect:.2e})"
    diff = max_abs(got, want)
    assert diff <= tolerance, f"{layout}: max|logits - transformers'| = {diff:.3e} > {tolerance:.3e}"


def _edited_base(src: Path, dst: Path, *, drop: str = "", add: str = "") -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        tensors.pop(drop, None)
        if add:
            tensors[add] = torch.zeros(2, 2)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return dst


@pytest.mark.needs("build", "load_report")
def test_a_missing_or_extra_tensor_is_refused_or_reported_by_name(drive, driver_name, conformance_base, tmp_path):
    bases = (
        ("missing", str(_edited_base(conformance_base, tmp_path / "missing", drop=DROPPED))),
        ("extra", str(_edited_base(conformance_base, tmp_path / "extra", add=ADDED))),
    )
    for rank, seen in enumerate(drive(build_bad_bases, BadBaseCase(driver_name, bases))):
        for label, offender, field in (("missing", DROPPED, "missing"), ("extra", ADDED, "unexpected")):
            got = seen[label]
            if got["error"]:
                named = offender in got["error"] or offender.removesuffix(".weight") in got["error"]
                assert named, f"rank {rank}: the {label} base was refused without naming {offender}: {got['error']}"
                continue
            listed = [n.removesuffix(".weight") for n in getattr(got["report"], field)]
            assert offender.removesuffix(".weight") in listed, (
                f"rank {rank}: the {label} base loaded and its report does not list {offender} as {field}: "
                f"{got['report']}"
            )

"""The ``dsv4-lora`` command line, driven as a user drives it (subprocesses)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import fixtures.asserts as ah
from fixtures.data.adapter_tamper import TAMPER, UNCERTIFY
from fixtures.runner.qualify_runs import GROUP as QUALIFY_GROUP
from fixtures.runner.subproc import cli_runner

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(QUALIFY_GROUP)]

#: units of eps(float32) * the recomputed loss: qualify's losses are the native fp32 forward's, recomputed here on
#: transformers (+ stock PEFT merged), two fp32 forwards whose logits differ by a few units and whose token losses
#: (each moved by at most 2 max|Δ logit|) average out in the mean; 8 leaves room
LOSS_ULPS = 8
#: units of eps(float32) * the recomputed max|logits|: qualify takes the scale from its own PEFT reload (merged or
#: not), this test from stock PEFT merged, two fp32 forwards of one function (max|.| moves by at most max|Δ|)
SCALE_ULPS = 32
#: units of eps(float64) * the margin: qualify divides the same two float64s that its JSON prints (repr round-trips
#: them exactly), so one division rounded the same way; 2 allows a rounding of each side
MARGIN_ULPS = 2

#: qualify's checks, in order (its module docstring, ``dsv4_lora.qualify_driver``)
QUALIFY_CHECKS = ["detect", "targets", "load", "base_logits", "train", "export", "reload"]


@pytest.fixture(scope="session")
def dsv4(impl):
    """Run the implementation's command line (``python -m <impl>.cli``, so ``--impl`` reaches it too)."""
    return cli_runner(impl.name, timeout=600)


@pytest.fixture(scope="session")
def qualified(qualify_runs) -> Path:
    """The default ``qualify`` run (one per worker, shared with test_qualify_any_driver); its base and adapter are
    reused by the other cases, never modified."""
    done = qualify_runs()
    assert done.status == 0, f"default qualify failed:\n{done.printed[-8000:]}"
    return done.out


def test_every_subcommand_has_help(dsv4):
    for sub in ([], ["qualify"], ["verify-adapter"], ["coverage"]):
        result = dsv4(*sub, "--help", timeout=120)
        assert result.returncode == 0 and "usage: dsv4-lora" in result.stdout, (sub, result.stderr[-2000:])


@pytest.mark.bridge_path
def test_default_qualify_passes_and_reports_every_check(impl, qualified):
    report = json.loads((qualified / "qualify.json").read_text())
    assert report["ok"] is True
    assert [c["name"] for c in report["checks"]] == QUALIFY_CHECKS
    failed = [c for c in report["checks"] if c["passed"] is not True]
    assert not failed, f"checks not passed: {failed}"
    assert set(report["versions"]) >= {"torch", "megatron-core", "megatron-bridge", "transformers", "peft"}
    # what an untested version would add (suites/reference/test_tested_versions.py): the main lane ran these
    assert "untested_versions" in report, sorted(report)
    assert (qualified / "adapter" / ".complete").exists()
    assert report["driver"] == f"{impl.name}.driver", f"qualify ran {report['driver']}, not the implementation's own"
    # the grouped o_a_proj reloaded unmerged: test_export_format's grouped PEFT layer tests
    reload = _check(report, "reload")["detail"]
    assert reload["observed"] <= reload["tolerance"] < reload["least_effect"], reload


def _check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def _oracle_loss(model, batch: list) -> float:
    """transformers' mean token cross-entropy on ``batch`` against the next token (the last position's label is the
    first token, as qualify's train step labels it)."""
    import torch

    ids = torch.tensor(batch)
    with torch.no_grad():
        logits = model(ids).logits.float()
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, dims=1).flatten()))


def _merged_oracle(qualified: Path):
    """Stock PEFT (not the implementation's loader) merges the exported adapter into transformers' model."""
    from peft import PeftModel

    from tiny_models.oracle import load_oracle

    return PeftModel.from_pretrained(load_oracle(qualified / "base"), str(qualified / "adapter")).merge_and_unload()


@pytest.mark.bridge_path
def test_qualify_trains_on_one_fixed_batch_and_its_loss_falls(qualified):
    """The first reported loss is transformers' loss on the one recorded batch with the base alone (the adapters
    start at zero), the judge's loss of the export is the exported adapter's, merged by stock PEFT; the losses fall
    and the export's is below the base's."""
    import torch

    from tiny_models.oracle import load_oracle

    train = _check(json.loads((qualified / "qualify.json").read_text()), "train")["detail"]
    first = _oracle_loss(load_oracle(qualified / "base"), train["batch"])
    trained = _oracle_loss(_merged_oracle(qualified), train["batch"])
    for reported, recomputed, of_what, context in (
        ("first_loss", first, "the loss of its recorded batch", "else it did not train on that batch"),
        ("trained_loss", trained, "the exported adapter's loss on the batch", ""),
    ):
        what = f"qualify's {reported} {train[reported]:.6f} vs {of_what} {recomputed:.6f}"
        diff = abs(train[reported] - recomputed)
        ah.assert_within_ulps(diff, dtype=torch.float32, ulps=LOSS_ULPS, scale=recomputed, what=what, context=context)
    assert train["loss_fell"] is True and train["last_loss"] < first, f"the losses did not fall: {train['losses']}"
    assert trained < first, f"the exported adapter does not lower the loss: {first:.4f} -> {trained:.4f}"


@pytest.mark.bridge_path
def test_qualify_reload_tolerance_scales_with_the_logits_and_reports_its_margin(qualified):
    """tolerance = 256 * eps(float32) * max|reloaded logits| (docs/commands.md, qualify); the report holds the
    observed figure and margin = tolerance / observed, and the margin leaves room for another machine's rounding."""
    import torch

    report = json.loads((qualified / "qualify.json").read_text())
    reload, batch = _check(report, "reload")["detail"], _check(report, "train")["detail"]["batch"]
    with torch.no_grad():
        scale = float(_merged_oracle(qualified)(torch.tensor(batch)).logits.abs().max())
    ah.assert_within_ulps(
        abs(reload["logit_scale"] - scale), dtype=torch.float32, ulps=SCALE_ULPS, scale=scale, what="logit scale"
    )
    want_tol = 256 * torch.finfo(torch.float32).eps * scale
    # linear in the scale: the scale's own tolerance, carried over
    ah.assert_within_ulps(
        abs(reload["tolerance"] - want_tol), dtype=torch.float32, ulps=SCALE_ULPS, scale=want_tol, what="tolerance"
    )
    assert reload["observed"] <= reload["tolerance"], reload
    ah.assert_within_ulps(
        abs(reload["margin"] - reload["tolerance"] / reload["observed"]),
        dtype=torch.float64,
        ulps=MARGIN_ULPS,
        scale=reload["margin"],
        what="margin vs tolerance / observed",
        context=str(reload),
    )
    assert reload["margin"] >= 4, f"reload margin {reload['margin']:.1f}: one machine away from a false failure"


#: transformers' DeepseekV4Attention module names of the five targets (modeling_deepseek_v4)
TRANSFORMERS_LEAVES = {"wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}


@pytest.mark.bridge_path
def test_qualify_reload_could_see_the_least_module_of_the_adapter_lost(qualified, tmp_path):
    """The reload's tolerance lies below the effect of the adapter's least module (one target in one layer), and
    stock PEFT alone measures that module's effect again (its lora_B zeroed, merged) to within the rounding of the
    two measurements (one tolerance each); the same target in another layer moves the logits no less."""
    import torch

    from fixtures.asserts.adapter_effects import part_effect

    report = json.loads((qualified / "qualify.json").read_text())
    reload, batch = _check(report, "reload")["detail"], _check(report, "train")["detail"]["batch"]
    tol, least, module = reload["tolerance"], reload["least_effect"], reload["least_effect_of"]
    assert tol < least, f"the reload could not see {module} lost: effect {least:.2e} <= tolerance {tol:.2e}"
    found = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.(\w+)", module)
    assert found and found[2] in TRANSFORMERS_LEAVES.values(), f"the least module {module} is no main target"
    layer, leaf = int(found[1]), found[2]
    other = 1 - layer if layer < 2 else 0
    ids, base, adapter = torch.tensor(batch), qualified / "base", qualified / "adapter"
    measured = part_effect(base, adapter, ids, lambda n, lf: (n, lf) == (layer, leaf), tmp_path / "least")
    assert abs(measured - least) <= 2 * tol, f"{module}: reported effect {least:.4e}, stock PEFT {measured:.4e}"
    elsewhere = part_effect(base, adapter, ids, lambda n, lf: (n, lf) == (other, leaf), tmp_path / "other")
    assert elsewhere >= least - 2 * tol, f"layer {other}'s {leaf} moves the logits {elsewhere:.2e} < least {least:.2e}"


def _copy_base(qualified: Path, tmp_path: Path) -> Path:
    base = tmp_path / "base"
    shutil.copytree(qualified / "base", base)
    return base


def test_qualify_rejects_a_v3_config(dsv4, qualified, tmp_path):
    base = _copy_base(qualified, tmp_path)
    cfg = json.loads((base / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
    (base / "config.json").write_text(json.dumps(cfg))
    result = dsv4("qualify", "--base", base, "--out", tmp_path / "out")
    assert result.returncode == 1
    assert "detect" in result.stdout and "DeepseekV3ForCausalLM" in result.stdout, result.stdout[-3000:]


def test_qualify_rejects_a_corrupt_safetensors_file(dsv4, qualified, tmp_path):
    base = _copy_base(qualified, tmp_path)
    (st,) = base.glob("*.safetensors")
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = dsv4("qualify", "--base", base, "--out", tmp_path / "out")
    assert result.returncode == 1
    assert st.name in result.stdout + result.stderr, (result.stdout[-3000:], result.stderr[-3000:])


@pytest.mark.bridge_path
def test_qualify_names_a_missing_tensor(dsv4, qualified, tmp_path):
    base = _copy_base(qualified, tmp_path)
    (st,) = base.glob("*.safetensors")
    tensors = load_file(st)
    del tensors["layers.1.attn.wq_b.weight"]
    save_file(tensors, st)
    result = dsv4("qualify", "--base", base, "--out", tmp_path / "out")
    assert result.returncode == 1
    assert "layers.1.attn.wq_b.weight" in result.stdout, result.stdout[-3000:]


def test_qualify_rejects_a_bad_target(dsv4, qualified, tmp_path):
    result = dsv4("qualify", "--base", qualified / "base", "--targets", "wq_a,no_such_proj", "--out", tmp_path / "out")
    assert result.returncode == 1
    text = result.stdout + result.stderr
    assert "no_such_proj" in text and "TargetError" in text, text[-3000:]


# ---------------------------------------------------------------------------------------------- verify-adapter


def test_verify_adapter_accepts_the_qualified_adapter(dsv4, qualified):
    result = dsv4("verify-adapter", "--base", qualified / "base", "--adapter", qualified / "adapter", "--forward")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "PASSED" in result.stdout and "forward" in result.stdout


def _edited_copies(qualified: Path, tmp_path: Path, edit) -> tuple[Path, Path]:
    """Copies of qualify's base and adapter under ``tmp_path``, then ``edit(adapter, base)`` applied to them."""
    base, adapter = _copy_base(qualified, tmp_path), tmp_path / "adapter"
    shutil.copytree(qualified / "adapter", adapter)
    edit(adapter, base)
    return base, adapter


def _verify_edited_copies(dsv4, qualified: Path, tmp_path: Path, table: dict, case: str):
    """verify-adapter on copies of qualify's base and adapter edited as ``table[case]`` says
    (``fixtures/data/adapter_tamper.py``): what the case expects it to say, its run, and the copies."""
    edit, expected = table[case]
    base, adapter = _edited_copies(qualified, tmp_path, edit)
    return expected, dsv4("verify-adapter", "--base", base, "--adapter", adapter), (base, adapter)


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_verify_adapter_catches(dsv4, qualified, tmp_path, case):
    expected, result, _ = _verify_edited_copies(dsv4, qualified, tmp_path, TAMPER, case)
    assert result.returncode == 1, f"{case}: verify-adapter passed a tampered adapter:\n{result.stdout[-3000:]}"
    assert expected in result.stdout, f"{case}: problem list does not name {expected!r}:\n{result.stdout[-3000:]}"


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_validate_adapter_dir_raises_the_first_problem_verify_adapter_lists(impl, qualified, tmp_path, case):
    """One list of checks, two reporters: on the same tampered adapter, the library's validate_adapter_dir fails
    closed with exactly the first problem that verify-adapter lists."""
    tamper, _ = TAMPER[case]
    base, adapter = _edited_copies(qualified, tmp_path, tamper)
    listed = impl.verify_adapter(base, adapter).problems
    assert listed, f"{case}: verify_adapter lists no problem"
    with pytest.raises(impl.Dsv4Error) as info:
        impl.validate_adapter_dir(adapter, base=base)
    assert str(info.value) == listed[0], f"{case}: validate raised {info.value!r}, verify listed first {listed[0]!r}"


@pytest.mark.parametrize("case", sorted(UNCERTIFY))
def test_verify_adapter_passes_an_uncertified_adapter_unless_certification_is_required(dsv4, qualified, tmp_path, case):
    expected, result, (base, adapter) = _verify_edited_copies(dsv4, qualified, tmp_path, UNCERTIFY, case)
    assert result.returncode == 0, f"{case}: a sound adapter failed:\n{result.stdout[-3000:]}"
    assert "UNCERTIFIED" in result.stdout and expected in result.stdout, result.stdout[-3000:]
    strict = dsv4("verify-adapter", "--base", base, "--adapter", adapter, "--require-certified")
    assert strict.returncode == 1 and expected in strict.stdout, strict.stdout[-3000:]


def test_coverage_of_the_flash_manifest_is_complete(dsv4):
    result = dsv4("coverage", "--manifest", "flash", "--limit", "5", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "unmapped 0" in result.stdout and "missing 0" in result.stdout


def test_coverage_reports_the_upstream_layout_when_asked(dsv4):
    result = dsv4("coverage", "--manifest", "tiny-mixed", "--layout", "upstream", "--limit", "100000", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "native (upstream)" in result.stdout, result.stdout[:500]
    wq_b, hc_scale = rows["layers.0.attn.wq_b.weight"], rows["layers.0.hc_attn_scale"]
    assert wq_b.endswith("decoder.layers.0.self_attention.linear_q_up_proj.weight"), wq_b
    alphas = " + ".join(f"decoder.layers.0.self_attention_hyper_connection.alpha_{p}" for p in ("pre", "post", "res"))
    assert hc_scale.endswith(alphas), hc_scale

"""``dsv4-lora qualify --driver MODULE`` qualifies any implementation through its driver alone, judged by the
conformance judge: the reference passes every check, a driver whose bare target reaches the DSA indexer fails
``targets`` naming the indexer's module, a driver that implements nothing fails every check naming the method, and
each judged check fails on the one defect it claims to catch (a payload with that defect, judged in this process)."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dsv4_lora.qualify_driver import judge_run
from fixtures.runner.qualify_runs import GROUP as QUALIFY_GROUP
from fixtures.runner.subproc import cli_runner, run

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group(QUALIFY_GROUP)]

#: the implementation's own driver, which ``qualify`` runs without ``--driver`` (its runs are shared with test_cli)
REFERENCE = None
#: the checks of a driver's qualify, in the order the command prints them
CHECKS = ["detect", "targets", "load", "base_logits", "train", "export", "reload"]


@pytest.fixture(scope="session")
def dsv4(impl):
    return cli_runner(impl.name, timeout=600)


@pytest.fixture(scope="session")
def through_driver(qualify_runs):
    """``qualify [--driver DRIVER] [OPTION ...]`` once per driver, options and worker (``REFERENCE``: no
    ``--driver``): (exit status, printed output, JSON report, out)."""

    def run(driver: str | None, *options: str) -> tuple[int, str, dict, Path]:
        done = qualify_runs(*(("--driver", driver) if driver else ()), *options)
        return done.status, done.printed, done.report, done.out

    return run


def _checks(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_the_reference_through_its_driver_passes_every_judged_check(impl, through_driver):
    status, printed, report, out = through_driver(REFERENCE)
    checks = _checks(report)
    assert status == 0 and report["ok"] is True, printed[-4000:]
    assert report["driver"] == f"{impl.name}.driver"
    assert list(checks) == CHECKS
    assert all(c["passed"] is True for c in checks.values()), checks
    for name in ("base_logits", "reload"):  # each comparison held below the least defect it claims to see
        d = checks[name]["detail"]
        assert d["observed"] <= d["tolerance"] < d["least_effect"], (name, d)
    train = checks["train"]["detail"]
    assert train["first_loss"] == train["losses"][0] and train["loss_fell"] is True, train
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_a_bf16_run_is_reloaded_in_float32_by_importing_its_export_and_every_comparison_proves_its_power(
    through_driver,
):
    """bf16 rounding of a whole forward hides one module's delta; the driver's ``import_adapter`` puts the export
    into a float32 build, whose logits PEFT's reload must give within the float32 rule."""
    status, printed, report, _ = through_driver(REFERENCE, "--dtype", "bfloat16")
    checks = _checks(report)
    assert status == 0 and all(c["passed"] is True for c in checks.values()), printed[-4000:]
    reload, base = checks["reload"]["detail"], checks["base_logits"]["detail"]
    assert reload["compared"] == "a float32 build that imported the export", reload
    assert reload["observed"] <= reload["tolerance"] < reload["least_effect"], reload
    assert base["observed"] <= base["tolerance"] < base["least_effect"], base
    assert "mean|Δ|" in checks["base_logits"]["figure"], "bf16 logits are held by their mean difference"


def test_a_bare_target_that_reaches_the_indexer_fails_targets_naming_the_indexer_module(through_driver):
    status, printed, report, _ = through_driver("implementations.wrong.indexer_targets", "--no-oracle")
    checks = _checks(report)
    assert status == 1 and report["ok"] is False, printed[-4000:]
    assert checks["targets"]["passed"] is False
    assert any(".indexer.wq_b" in m for m in checks["targets"]["detail"]["not_meant"]), checks["targets"]
    assert checks["detect"]["passed"] and checks["load"]["passed"], "the defect is the targets', not the base's"


def test_a_driver_that_implements_nothing_fails_every_check_naming_the_missing_method(tmp_path):
    """Run as a user runs it: the installed ``dsv4-lora`` in the directory holding the driver module (which is not
    an installed package), so the driver is found there, by the launcher and by every rank."""
    installed = Path(sys.executable).with_name("dsv4-lora")
    done = run([str(installed), "qualify", "--driver", "implementations.empty", "--out", str(tmp_path)], timeout=300)
    status, printed = done.returncode, done.stdout + done.stderr
    report = json.loads((tmp_path / "qualify.json").read_text())
    checks = _checks(report)
    assert status == 1, printed[-4000:]
    assert all(c["passed"] is False for c in checks.values()), checks
    assert "DriverMissing: recognises" in checks["detect"]["figure"]
    assert "DriverMissing: qualify" in checks["targets"]["figure"]
    assert "Traceback" not in printed, printed[-4000:]


def test_an_export_in_the_official_dialect_is_judged_by_peft_reloading_its_transformers_reading(through_driver):
    """``--dialect official`` (vLLM's names): the driver writes checkpoint names, and the judge reads them back as
    transformers' names, so PEFT's reload still judges the numbers, with its power."""
    status, printed, report, out = through_driver(REFERENCE, "--dialect", "official")
    checks = _checks(report)
    assert status == 0 and all(c["passed"] is True for c in checks.values()), printed[-4000:]
    assert checks["export"]["detail"]["dialect"] == "official"
    keys = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.layers.") and ".attn." in k for k in keys), sorted(keys)[:3]
    d = checks["reload"]["detail"]
    assert d["observed"] <= d["tolerance"] < d["least_effect"], d


def test_a_dialect_the_driver_does_not_declare_is_refused_before_anything_runs(dsv4, tmp_path):
    done = dsv4("qualify", "--driver", "implementations.empty", "--dialect", "sglang", "--out", tmp_path / "q")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--dialect sglang: driver implementations.empty declares the dialects ['transformers']" in done.stderr
    assert not (tmp_path / "q").exists()


def test_a_driver_module_that_cannot_be_imported_is_refused_naming_it_and_what_to_do(dsv4, tmp_path):
    done = dsv4("qualify", "--driver", "no_such_driver_module", "--out", tmp_path / "q", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--driver no_such_driver_module: No module named 'no_such_driver_module'" in done.stderr
    assert "PYTHONPATH" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "q").exists()


# -- the judge's power: each check fails on its own defect --------------------------------------------------------


@pytest.fixture(scope="module")
def reference_run(impl, through_driver):
    """The reference's passing run, rebuilt as the ranks' payload: (payload, DriverRun), to be spoiled one way."""
    from dsv4_conformance.judge.oracle import fixed_batch, peft_logits
    from dsv4_lora.qualify_driver import driver_run

    _, _, report, out = through_driver(REFERENCE)
    checks = _checks(report)
    run = driver_run(
        report["driver"], str(out / "base"), str(out), **{k: report["options"][k] for k in ("targets", "rank", "alpha")}
    )

    ids, _ = fixed_batch(run.base, run.seed)
    config = json.loads((out / "base" / "config.json").read_text())
    found = {
        "recognised": True,
        "recognised_lookalike": False,
        "modules": sorted(f"layers.{i}.attn.{t}" for i in range(config["num_hidden_layers"]) for t in run.lora.targets),
        "load": checks["load"]["detail"],
        "base_logits": _oracle_logits(run.base, ids),
        "losses": checks["train"]["detail"]["losses"],
        "trained_logits": peft_logits(Path(run.base), Path(run.adapter_dir), ids).numpy(),
        "exported": True,
    }
    seconds = dict.fromkeys(("detect", "targets", "base", "train", "export", "reload"), 0.0)
    return {"rank": 0, "found": found, "errors": {}, "seconds": seconds}, run


def _oracle_logits(base: str, ids):
    import torch

    from dsv4_conformance.judge.oracle import base_model

    with torch.no_grad():
        return base_model(Path(base))(ids).logits.float().numpy()


def _judged(payload: dict, run, *, oracle: bool = True, **found) -> dict[str, object]:
    spoiled = {**payload, "found": {**payload["found"], **found}}
    return {c.name: c for c in judge_run([spoiled], run, marker=None, oracle=oracle)}


def test_the_unspoiled_payload_passes_every_check(reference_run):
    payload, run = reference_run
    failed = [c for c in _judged(payload, run).values() if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize(
    ("check", "spoil"),
    [
        ("detect", lambda f: {"recognised_lookalike": True}),
        ("detect", lambda f: {"recognised": False}),
        ("targets", lambda f: {"modules": f["modules"][1:]}),
        ("targets", lambda f: {"modules": [*f["modules"], "layers.0.attn.indexer.wq_b"]}),
        ("load", lambda f: {"load": {**f["load"], "missing": ["layers.0.attn.wq_a.weight"]}}),
        ("load", lambda f: {"load": {**f["load"], "unexpected": ["layers.9.attn.wq_a.weight"]}}),
        ("train", lambda f: {"losses": list(reversed(f["losses"]))}),
        ("train", lambda f: {"losses": [*f["losses"][:-1], float("nan")]}),
    ],
    ids=[
        "lookalike-recognised",
        "base-not-recognised",
        "one-module-missing",
        "indexer-wrapped",
        "missing-tensor",
        "unexpected-tensor",
        "loss-rises",
        "loss-nan",
    ],
)
def test_each_bookkeeping_check_fails_on_its_own_defect(reference_run, check, spoil):
    payload, run = reference_run
    judged = _judged(payload, run, oracle=False, **spoil(payload["found"]))  # the comparisons: tests below
    assert judged[check].passed is False, judged[check]
    assert all(c.passed is not False for name, c in judged.items() if name != check), "only the spoiled check fails"


def test_an_mtp_blocks_own_main_attention_is_allowed_beside_the_meant_modules(reference_run):
    payload, run = reference_run
    judged = _judged(payload, run, oracle=False, modules=[*payload["found"]["modules"], "mtp.0.attn.wq_a"])
    assert judged["targets"].passed is True, judged["targets"]


@pytest.mark.parametrize("check", ["base_logits", "trained_logits"])
def test_logits_moved_by_more_than_the_rule_fail_their_comparison(reference_run, check):
    payload, run = reference_run
    moved = payload["found"][check].copy()
    moved[0, 0, 0] += 1e-2  # above either tolerance (1e-4 here), below any one module's or layer's effect
    judged = _judged(payload, run, **{check: moved})
    name = "reload" if check == "trained_logits" else check
    assert judged[name].passed is False and not judged[name].inconclusive, judged[name]


def test_losses_of_another_batch_fail_train_against_the_judges_own_loss(reference_run):
    """The reported losses moved by 1e-2, which the test requires to exceed the judge's loss tolerance while another
    batch's effect exceeds it too: the first is no longer transformers' loss on the fixed batch."""
    payload, run = reference_run
    judged = _judged(payload, run, losses=[x + 1e-2 for x in payload["found"]["losses"]])
    train = judged["train"]
    assert train.passed is False and "not transformers'" in train.figure, train
    assert train.detail["first_loss_observed"] > train.detail["first_loss_tolerance"], train.detail
    assert train.detail["other_batch_effect"] > train.detail["first_loss_tolerance"], "the comparison had no power"


def test_an_export_that_does_not_lower_the_loss_fails_train_whatever_the_driver_reports(reference_run, tmp_path):
    """The driver reports falling losses, but its export's lora_B are zero: the judge's own loss of the export (PEFT
    on transformers) equals the base's, so train fails."""
    payload, run = reference_run
    adapter = tmp_path / "adapter"
    shutil.copytree(run.adapter_dir, adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(
        {k: t.zero_() if ".lora_B." in k else t for k, t in tensors.items()}, str(adapter / "adapter_model.safetensors")
    )
    judged = {c.name: c for c in judge_run([payload], replace(run, adapter_dir=str(adapter)), marker=None)}
    assert judged["train"].passed is False and "does not lower it" in judged["train"].figure, judged["train"]


def test_an_export_one_tensor_short_fails_export_naming_the_module(reference_run, tmp_path):
    payload, run = reference_run
    adapter = tmp_path / "adapter"
    shutil.copytree(run.adapter_dir, adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    judged = {c.name: c for c in judge_run([payload], replace(run, adapter_dir=str(adapter)), marker=None)}
    assert judged["export"].passed is False, judged["export"]
    assert judged["reload"].passed is not True, judged["reload"]


def test_a_declared_success_marker_that_is_not_there_fails_export(reference_run):
    payload, run = reference_run
    judged = {c.name: c for c in judge_run([payload], run, marker="NO-SUCH-MARKER")}
    assert judged["export"].passed is False and "marker" in judged["export"].figure, judged["export"]


def test_a_step_that_raised_on_another_rank_fails_its_checks_naming_that_rank(reference_run):
    payload, run = reference_run
    other = {"rank": 1, "found": {}, "errors": {"train": "RuntimeError: boom"}, "seconds": {}}
    judged = {c.name: c for c in judge_run([payload, other], run, marker=None)}
    assert judged["train"].passed is False and judged["train"].figure == "rank 1: RuntimeError: boom"
    assert judged["export"].passed is True, "the other steps are judged from rank 0's findings"


# -- an export in another dialect: the names must be that dialect's; then it is judged as transformers' ----------


def _official_module(module: str) -> str:
    """transformers' module name as the checkpoint names it (the oracle's own table, not the judge's)."""
    from tiny_models.oracle import transformers_to_official_name

    return transformers_to_official_name(f"{module}.weight").removesuffix(".weight")


def _sglang_module(module: str) -> str:
    """SGLang's name: transformers' tree with the checkpoint's leaf (``model.layers.N.self_attn.wq_a``)."""
    official = _official_module(module)  # layers.N.attn.<leaf>
    layer, leaf = official.split(".")[1], official.rsplit(".", 1)[1]
    return f"model.layers.{layer}.self_attn.{leaf}"


def _in_dialect(run, tmp_path: Path, rename, target_modules) -> Path:
    """The reference's transformers export rewritten with every module renamed by ``rename``."""
    adapter = tmp_path / "adapter"
    shutil.copytree(run.adapter_dir, adapter)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model."
    renamed = {}
    for key, tensor in tensors.items():
        module, half = key.removeprefix(prefix).rsplit(".lora_", 1)
        renamed[f"{prefix}{rename(module)}.lora_{half}"] = tensor
    save_file(renamed, str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = target_modules
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


LEAVES = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b"]
DIALECT_NAMES = {"official": _official_module, "sglang": _sglang_module}


@pytest.mark.parametrize("dialect", ["official", "sglang"])
def test_an_export_in_each_dialect_passes_and_the_same_names_asked_as_another_dialect_fail(
    reference_run, tmp_path, dialect
):
    payload, run = reference_run
    adapter = _in_dialect(run, tmp_path, DIALECT_NAMES[dialect], LEAVES)
    judged = {
        c.name: c for c in judge_run([payload], replace(run, adapter_dir=str(adapter), dialect=dialect), marker=None)
    }
    assert all(c.passed for c in judged.values()), [c for c in judged.values() if not c.passed]
    other = "sglang" if dialect == "official" else "official"
    asked = replace(run, adapter_dir=str(adapter), dialect=other)
    judged = {c.name: c for c in judge_run([payload], asked, marker=None, oracle=False)}
    assert judged["export"].passed is False and f"not of dialect {other}'s" in judged["export"].figure, judged["export"]


@pytest.mark.parametrize(
    ("target_modules", "says"),
    [(LEAVES[:3] + LEAVES[4:], "leaves out ['wo_a']"), (r".*\.attn\.w.*", "is a regex")],
    ids=["a-held-leaf-left-out", "a-regex"],
)
def test_target_modules_in_another_dialect_must_name_every_held_leaf_as_a_list(
    reference_run, tmp_path, target_modules, says
):
    payload, run = reference_run
    adapter = _in_dialect(run, tmp_path, _official_module, target_modules)
    asked = replace(run, adapter_dir=str(adapter), dialect="official")
    judged = {c.name: c for c in judge_run([payload], asked, marker=None, oracle=False)}
    assert judged["export"].passed is False and says in judged["export"].figure, judged["export"]


@pytest.mark.parametrize(
    ("spoil", "passes"), [("none", True), ("shape", False), ("nan", False)], ids=["as-trained", "wrong-shape", "nan"]
)
def test_an_official_mtp_tensor_is_held_to_the_bases_weight_of_its_name(reference_run, tmp_path, spoil, passes):
    """transformers has no MTP layer, so an official export's ``mtp.N.attn`` tensors stay out of its transformers
    reading: each must fit the base's weight of the same name and be finite."""
    import torch
    from safetensors import safe_open

    payload, run = reference_run
    adapter = _in_dialect(run, tmp_path, _official_module, LEAVES)
    (shard,) = Path(run.base).glob("*.safetensors")
    with safe_open(str(shard), "pt") as f:
        out_features, in_features = f.get_slice("mtp.0.attn.wq_a.weight").get_shape()
    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
    lora_a = torch.full((rank, in_features + (spoil == "shape")), float("nan") if spoil == "nan" else 0.01)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.mtp.0.attn.wq_a.lora_A.weight"] = lora_a
    tensors["base_model.model.mtp.0.attn.wq_a.lora_B.weight"] = torch.zeros(out_features, rank)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    asked = replace(run, adapter_dir=str(adapter), dialect="official")
    export = {c.name: c for c in judge_run([payload], asked, marker=None, oracle=False)}["export"]
    assert export.passed is passes, export
    if not passes:
        assert "mtp.0.attn.wq_a.lora_A" in export.figure, export

"""The serving engines decide what "loads" means: vLLM's and SGLang's own code, installed for real in
environments of their own (scripts/install_consumers.sh), judges every target of adapters the implementation
exported in each dialect, and the implementation's stated beliefs (``CONSUMER_RULES``) must match every answer.

The expected values come from the engines (fixtures/consumers/probe_*.py run their loaders, mappers, packing,
skip prefixes, target normalization and forward code); the implementation's table is what is under test. When
an engine release changes its answer, these tests fail until the table (and what depends on it) follows.
One lane per engine release (``fixtures.consumers.LANES``: vLLM 0.33.0 and 0.34.0 each in its own environment):
each release's cells are decided by that release's code, and every release the table holds rules for must have
been run. Skipped, with the reason, only where a consumer environment is not installed.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from fixtures.consumers import (
    HERE,
    LANES,
    MTP_ROW,
    TARGETS,
    VLLM_LANES,
    WHOLE_ROW,
    AdapterCase,
    Cell,
    ConsumerEnvMissing,
    cells,
    consumer_python,
    export_cases,
    readme_section,
    render_matrix,
    run_probe,
)
from tiny_models.golden import NAMINGS

pytestmark = [pytest.mark.cpu, pytest.mark.consumer_env, pytest.mark.xdist_group("consumers")]

ROOT = Path(__file__).resolve().parents[2]
#: the golden vectors (golden/v1/README.md): every probe also judges their adapters, each naming, one target each
GOLDEN = ROOT / "golden" / "v1"
GOLDEN_CASES = [
    AdapterCase(naming, target, GOLDEN / "adapters" / naming / target) for naming in NAMINGS for target in TARGETS
]
#: lane -> the probe's control run (same process): vLLM 0.34 had it wrapped wo_a in the generic
#: ColumnParallelLinearWithLoRA, which does not override grouped_forward
GENERIC = "vllm.lora.layers.column_parallel_linear:ColumnParallelLinearWithLoRA"
CONTROLS = {"vllm-0.34": ("--control", f"DeepseekV4GroupedWoA={GENERIC}")}


@pytest.fixture(scope="module")
def exported(impl, tmp_path_factory):
    return export_cases(impl, tmp_path_factory.mktemp("consumer-adapters"))


@pytest.fixture(scope="module")
def probed(exported) -> dict[str, tuple[dict, list[Cell], list[str]]]:
    """lane -> (raw report, cells, notes); only lanes whose environment is installed. The same run judges the
    golden vectors' adapters (:data:`GOLDEN_CASES`, read by :func:`test_each_engine_judges_the_golden_adapters_by_the_same_rules`)."""
    cases, config = exported
    paths = sorted({c.path for c in cases if c.path is not None})
    out = {}
    for name in LANES:
        try:
            consumer_python(name)
        except ConsumerEnvMissing:
            continue
        report = run_probe(name, paths, config, options=CONTROLS.get(name, ()), golden=GOLDEN)
        out[name] = (report, *cells(report, cases))
    return out


@pytest.fixture(scope="module")
def numeric(impl, probed, tmp_path_factory) -> dict | None:
    """The matrix's numeric column (fixtures/consumers/numerics.py) of every installed vLLM lane; None without."""
    lanes = [lane for lane in VLLM_LANES if lane in probed]
    if not lanes:
        return None
    from fixtures.consumers.numerics import matrix_column, measured_once

    column = {}
    for lane in lanes:
        column.update(matrix_column(impl, measured_once(impl, tmp_path_factory, lane)))
    return column


def _absent(what: str) -> None:
    """Skip where a consumer environment is not installed; CI (DSV4_REQUIRE_CONSUMERS=1) fails instead."""
    message = f"{what}: run scripts/install_consumers.sh"
    if os.environ.get("DSV4_REQUIRE_CONSUMERS") == "1":
        pytest.fail(message + " (DSV4_REQUIRE_CONSUMERS=1)")
    pytest.skip(message)


def _answers(probed, name: str) -> tuple[dict, list[Cell], list[str]]:
    if name not in probed:
        _absent(f"the {name} consumer lane is not installed")
    return probed[name]


def _cell(found: list[Cell], consumer: str, dialect: str, target: str) -> Cell:
    matches = [c for c in found if (c.consumer, c.dialect, c.target) == (consumer, dialect, target)]
    assert len(matches) == 1, f"the probe gave {len(matches)} answers for {consumer} {dialect} {target}"
    return matches[0]


def _disagreements(impl, found: list[Cell], what: str = "") -> list[str]:
    """One line per cell whose engine answer differs from the implementation's rule (or that has no rule)."""
    wrong = []
    for cell in found:
        rule = impl.consumer_rule(cell.consumer, cell.version, cell.dialect, cell.target)
        where = f"{cell.consumer} {cell.version} {what}{cell.dialect} {cell.target}"
        if rule is None:
            wrong.append(
                f"{where}: impl has no belief; the engine says {cell.status} ({cell.reason[:300]}) "
                f"[{'; '.join(cell.evidence)}]"
            )
        elif (str(rule.status), rule.routed_to) != (cell.status, cell.routed_to):
            wrong.append(
                f"{where}: impl believes {rule.status} (routed to {rule.routed_to}), the engine says {cell.status} "
                f"(routed to {cell.routed_to}): {cell.reason[:400]} [{'; '.join(cell.evidence)}]"
            )
    return wrong


@pytest.mark.parametrize("name", sorted(LANES))
def test_every_target_in_every_dialect_is_what_the_implementation_believes(impl, probed, name, record_property):
    report, found, notes = _answers(probed, name)
    record_property(f"{name}_matrix", [c.__dict__ for c in found])
    assert found, f"{name} {report['version']}: the probe judged no platform variant ({notes})"
    wrong = _disagreements(impl, found)
    assert not wrong, f"{len(wrong)} cell(s) where impl.CONSUMER_RULES disagrees with {name}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(LANES))
def test_each_engine_judges_the_golden_adapters_by_the_same_rules(impl, probed, name):
    """The golden vectors' adapters (what an engine's own CI loads: each naming, one target each, on the golden base)
    get from every engine the verdict the rules give ours: the rules describe the engine, not our exporter."""
    report, _, _ = _answers(probed, name)
    found, _ = cells(report, GOLDEN_CASES)
    assert found, f"{name} {report['version']}: the probe judged none of golden/v1's adapters"
    wrong = _disagreements(impl, found, "golden/v1 ")
    assert not wrong, f"{len(wrong)} golden adapter(s) judged otherwise than the rules say:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(LANES))
def test_the_implementation_holds_no_belief_the_engine_was_not_asked(impl, probed, name):
    report, found, _ = _answers(probed, name)
    asked = {(c.consumer, c.version, c.dialect, c.target) for c in found}
    stale = [
        f"{r.consumer} {r.version} {r.dialect} {r.target}"
        for r in impl.CONSUMER_RULES
        if r.consumer.split("/")[0] == LANES[name]
        and r.version == report["version"]
        and (r.consumer, r.version, r.dialect, r.target) not in asked
    ]
    assert not stale, f"impl.CONSUMER_RULES has rows the {name} lane ({report['version']}) did not answer: {stale}"


def test_every_release_the_implementation_holds_rules_for_is_a_lane_that_ran(impl, probed):
    """A release no lane ran has no rules (so export and verify-adapter refuse it): every (engine, release) of
    impl.CONSUMER_RULES is the version some installed lane's own code reported."""
    if set(probed) != set(LANES):
        _absent(f"every release needs its lane (installed: {sorted(probed)} of {sorted(LANES)})")
    ran = {(LANES[name], probed[name][0]["version"]) for name in probed}
    unrun = sorted(
        {(r.consumer, r.version) for r in impl.CONSUMER_RULES if (r.consumer.split("/")[0], r.version) not in ran}
    )
    assert not unrun, f"impl.CONSUMER_RULES holds releases no lane ran: {unrun} (lanes ran {sorted(ran)})"
    assert len({v for family, v in ran if family == "vllm"}) == len(VLLM_LANES), (
        f"two vLLM lanes ran one release: {ran}"
    )


def test_sglang_normalizes_a_bare_wq_b_to_the_dsa_indexer(impl, probed):
    _, found, _ = _answers(probed, "sglang")
    for dialect in ("official", "sglang"):
        cell = _cell(found, "sglang", dialect, "wq_b")
        assert cell.routed_to == "indexer.wq_b", f"{dialect}: SGLang no longer renames wq_b: {cell}"
        said = [cell.reason, *cell.evidence, cell.if_accepted_reason or ""]
        assert any("get_normalized_target_modules" in text for text in said), f"{dialect}: {said}"
        rule = impl.consumer_rule("sglang", cell.version, dialect, "wq_b")
        assert rule is not None and rule.routed_to == cell.routed_to, f"impl does not know: {rule}"


#: (release, platform) -> wo_a's status in the official dialect and the words of the source reading's reason: each
#: release's expectation, strict (a release that starts applying wo_a fails it, and the matrix must follow)
WO_A = {
    ("0.33.0", "vllm/nvidia"): ("loaded_not_applied", "reads .weight directly"),  # deep_gemm_fp8_o_proj
    ("0.33.0", "vllm/xpu"): ("loaded_not_applied", "reads .bmm_weight directly"),
    ("0.34.0", "vllm/nvidia"): ("applied", "DeepseekV4GroupedWoAWithLoRA.grouped_forward reads lora_a_stacked"),
    ("0.34.0", "vllm/xpu"): ("loaded_not_applied", "reads .bmm_weight directly"),
}


@pytest.mark.parametrize("lane", VLLM_LANES)
def test_each_vllm_release_decides_wo_a_by_its_own_code(impl, probed, lane):
    report, found, _ = _answers(probed, lane)
    release = report["version"]
    expected = {platform: want for (version, platform), want in WO_A.items() if version == release}
    assert expected, f"vLLM {release} (lane {lane}): no wo_a expectation; add its rows to WO_A"
    for platform, (status, words) in expected.items():
        cell = _cell(found, platform, "official", "wo_a")
        assert cell.status == status, f"{platform} {release} wo_a: {cell.status}, expected {status}: {cell.reason}"
        assert words in cell.reason, f"{platform} {release} wo_a: {words!r} not in {cell.reason}"
        rule = impl.consumer_rule(platform, release, "official", "wo_a")
        assert rule is not None and str(rule.status) == cell.status, f"{platform} {release}: impl believes {rule}"
        for target in ("wq_a", "wq_b", "wkv", "wo_b"):
            assert _cell(found, platform, "official", target).status == "applied", f"{platform} {release} {target}"


@pytest.mark.parametrize("lane", VLLM_LANES)
def test_every_applied_target_reaches_the_lora_class_vllm_installs(probed, lane):
    """The source reading follows each use into the LoRA class vLLM's manager wraps the module in: an applied
    target's evidence names that class's method reading the LoRA buffers, on every platform with LoRA."""
    report, found, _ = _answers(probed, lane)
    for cell in (c for c in found if c.dialect == "official" and c.target in TARGETS and c.status == "applied"):
        wrapper = [e for e in cell.evidence if e.startswith("vllm/lora/layers/")]
        assert wrapper, (
            f"{cell.consumer} {report['version']} {cell.target}: applied without reaching a LoRA class: {cell.evidence}"
        )


def test_a_bypassed_lora_wrapper_reads_as_loaded_not_applied(probed, exported):
    """The control: had vLLM 0.34 wrapped wo_a in the generic ColumnParallelLinearWithLoRA (which does not override
    grouped_forward), the NVIDIA o-projection's wo_a.grouped_forward would run on the base layer alone; the reading
    must say so, where the class vLLM really installs reads as applied (above)."""
    report, _, _ = _answers(probed, "vllm-0.34")
    cases, _ = exported
    path = next(c.path for c in cases if (c.dialect, c.target) == ("official", "wo_a"))
    outcome = report["variants"]["nvidia"]["control"][str(path)]["modules"]["layers.0.attn.wo_a"]
    assert outcome["status"] == "loaded_not_applied", f"vLLM {report['version']} wo_a under {GENERIC}: {outcome}"
    assert "does not define .grouped_forward" in outcome["reason"], outcome["reason"]


@pytest.mark.parametrize("lane", VLLM_LANES)
def test_vllm_skips_the_mtp_layer_and_refuses_transformers_names(impl, probed, lane):
    _, found, _ = _answers(probed, lane)
    assert _cell(found, "vllm/nvidia", "official", MTP_ROW).status == "skipped"
    assert _cell(found, "vllm/nvidia", "transformers", WHOLE_ROW).status == "rejected"
    for target in (MTP_ROW, WHOLE_ROW):
        cell = _cell(found, "vllm/nvidia", "official" if target == MTP_ROW else "transformers", target)
        rule = impl.consumer_rule("vllm/nvidia", cell.version, cell.dialect, target)
        assert rule is not None and str(rule.status) == cell.status, f"{target}: impl believes {rule}, engine {cell}"


def test_the_consumer_matrix_is_the_generated_one(probed, exported, numeric):
    if set(probed) != set(LANES):
        _absent(f"the consumer matrix needs every consumer lane (installed: {sorted(probed)})")
    cases, _ = exported
    found = [c for name in LANES for c in probed[name][1]]
    notes = [n for name in LANES for n in probed[name][2]]
    section = readme_section((ROOT / "docs" / "consumers.md").read_text())
    assert section is not None, "docs/consumers.md lost its consumer-matrix markers"
    assert section == render_matrix(found, cases, notes, numeric), (
        "docs/consumers.md's consumer matrix differs from what the engines say now: run "
        "'.venv/bin/python scripts/consumer_matrix.py --write'"
    )


def test_every_row_of_the_matrix_has_an_answer_for_each_exported_adapter(probed, exported):
    cases, _ = exported
    for name in sorted(probed):
        _, found, _ = probed[name]
        for consumer in {c.consumer for c in found}:
            for case in cases:
                if case.path is not None:
                    _cell(found, consumer, case.dialect, case.target)
    assert {c.target for c in cases} == {WHOLE_ROW, MTP_ROW, *TARGETS}


def test_a_missing_consumer_environment_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CONSUMERS_DIR", str(tmp_path))
    with pytest.raises(ConsumerEnvMissing, match=r"scripts/install_consumers.sh vllm"):
        run_probe("vllm", [], None)


def test_the_probes_import_nothing_from_this_project():
    """The probes judge our adapters with the engines' code only: no impl, fixtures or tiny_models inside."""
    ours = {"impl", "fixtures", "tiny_models", "suites"}
    for path in sorted(HERE.glob("*.py")):
        if path.name in ("__init__.py", "numerics.py", "golden_numerics.py"):  # main-environment runners
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            leaked = [n for n in names if n.split(".")[0] in ours]
            assert not leaked, f"{path.name} imports {leaked}: the probes must run on the consumer's code only"


def test_exporting_for_an_engine_refuses_exactly_the_targets_it_would_not_apply(impl, probed, exported):
    """The fail-closed export follows the engines: for every (engine, dialect, target) the engine judged, an export
    of that one target for that engine succeeds when the engine applies it (and accepts the adapter), and raises
    ConsumerSupportError naming the target otherwise."""
    from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter
    from tiny_models.presets import get_preset

    cfg = get_preset("tiny-mixed")
    shapes = config_attention_shapes(cfg)
    wrong = []
    found = [c for name in sorted(probed) for c in probed[name][1]]
    whole = {(c.consumer, c.dialect): c.status for c in found if c.target == WHOLE_ROW}
    for cell in (c for c in found if c.target in TARGETS):
        state = impl.AdapterState(make_native_adapter({cell.target: shapes[cell.target]}, 2, 4), r=4, alpha=8.0)
        works = cell.status == "applied" and whole[cell.consumer, cell.dialect] == "loaded"
        try:
            impl.publish_in_memory(state, dialect=cell.dialect, consumer=cell.consumer, consumer_version=cell.version)
            refused = None
        except impl.ConsumerSupportError as exc:
            refused = str(exc)
        named = refused is None or any(f": {t}:" in refused for t in (cell.target, WHOLE_ROW))
        if works != (refused is None) or not named:
            wrong.append(f"{cell.consumer} {cell.dialect} {cell.target}: engine says {cell.status}, export {refused}")
    assert found and not wrong, "\n".join(wrong)


@pytest.mark.parametrize("lane", VLLM_LANES)
def test_official_names_are_vllms_own_module_paths_so_no_vllm_dialect_is_needed(probed, exported, lane):
    """vLLM's hf_to_vllm_mapper only prefixes ``model.``: every official decoder-layer module lands on the vLLM module
    of the same path (or the packed module beside it), so a separate vllm dialect would name the same modules."""
    report, _, _ = _answers(probed, lane)
    cases, _ = exported
    path = next(c.path for c in cases if (c.dialect, c.target) == ("official", WHOLE_ROW))
    modules = report["variants"]["nvidia"]["adapters"][str(path)]["modules"]
    landed = {m: o.get("consumer_module") for m, o in modules.items() if not m.startswith("mtp.")}
    assert landed, "the probe judged no decoder-layer module"
    off = {m: to for m, to in landed.items() if to is None or to.rsplit(".", 1)[0] != "model." + m.rsplit(".", 1)[0]}
    assert not off, f"vLLM's names differ from official beyond the model. prefix (a vllm dialect is needed): {off}"

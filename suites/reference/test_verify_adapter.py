"""``verify-adapter``'s checks through the public ``verify_adapter``: an exported adapter against its base passes and
is certified; each spoilt adapter or base is reported with the tensor or file that is wrong; provenance (the marker,
the base fingerprint) certifies only what it proves. The same cases run through the command line after a full
``qualify`` in ``test_cli``; here a tiny base and an exported adapter suffice, so they are fast."""

from __future__ import annotations

import json
import re

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fixtures.data.adapter_states import export_fingerprinted_adapter
from fixtures.data.adapter_tamper import TAMPER, UNCERTIFY
from fixtures.data.verify_cases import (
    ALPHA,
    PRESET,
    UNCHECKED,
    R,
    edited_copies,
    exported_pair,
    with_config,
)
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = pytest.mark.cpu

#: docs/fingerprint.md: a tensor of more bytes than 64 pages of 4096 is compared by those pages unless hashed in full
SAMPLED_ABOVE = 64 * 4096


@pytest.fixture(scope="module")
def exported(impl, tmp_path_factory):
    """A tiny base and an adapter exported against it (fixtures/data/verify_cases.py)."""
    return exported_pair(impl, tmp_path_factory.mktemp("verify"))


def test_an_exported_adapter_passes_against_its_base(impl, exported):
    base, adapter = exported
    result = impl.verify_adapter(base, adapter)
    assert result.ok and not result.problems, f"problems: {result.problems}"


@pytest.mark.parametrize("content", ["null", "[]", '"done"', "3"])
def test_a_marker_that_is_no_json_object_certifies_nothing(impl, exported, tmp_path, content):
    """A ``.complete`` that holds no object is present but certifies no file: the adapter beside it is refused,
    never certified (found by the property test: a re-saved adapter beside a ``null`` marker passed)."""
    base, adapter = edited_copies(exported, tmp_path, lambda a, b: (a / ".complete").write_text(content))
    result = impl.verify_adapter(base, adapter)
    assert not result.ok, f".complete = {content}: verify_adapter certified the adapter"
    assert any(".complete" in p and "expected an object" in p for p in result.problems), result.problems


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_each_spoilt_adapter_or_base_is_reported_by_name(impl, exported, tmp_path, case):
    tamper, expected = TAMPER[case]
    base, adapter = edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter)
    problems = "\n".join(result.problems)
    assert not result.ok, f"{case}: verify_adapter passed a spoilt adapter"
    assert expected in problems, f"{case}: the problem list does not name {expected!r}:\n{problems}"


@pytest.mark.parametrize("case", sorted(UNCERTIFY))
def test_a_sound_adapter_without_provenance_is_uncertified_not_wrong(impl, exported, tmp_path, case):
    """Without ``.complete`` an adapter cannot prove its completeness: it passes as uncertified, and fails only when
    certification is required, naming what is missing."""
    edit, expected = UNCERTIFY[case]
    base, adapter = edited_copies(exported, tmp_path, edit)
    result = impl.verify_adapter(base, adapter)
    assert result.ok, f"{case}: an otherwise sound adapter failed: {result.problems}"
    assert result.uncertified and expected in result.uncertified, f"{case}: provenance says {result.uncertified!r}"
    strict = impl.verify_adapter(base, adapter, require_certified=True)
    assert not strict.ok and any(expected in p for p in strict.problems), strict.problems


def test_an_exported_adapter_is_certified(impl, exported):
    result = impl.verify_adapter(*exported, require_certified=True)
    assert result.ok and result.uncertified is None, (result.problems, result.checks[-1])


def test_verify_adapter_reads_without_importing_torch(impl, exported):
    """The checks read bytes, shapes and dtypes: importing torch would cost the command about a second and
    ~500 MB before it reads anything (``pytest -m bench -s suites/reference/test_bench_full_size_base.py``)."""
    from fixtures.runner.subproc import cli_imports

    base, adapter = exported
    status, torch_imported, out = cli_imports(
        impl.name, ["verify-adapter", "--base", base, "--adapter", adapter], "torch"
    )
    assert status == 0 and not torch_imported, out[-4000:]


#: the spoilt adapters the conformance judge sees from the files alone (the others are about the base or provenance)
JUDGED = ("indexer-wrapping", "wrong-shape-lora_B", "nan", "missing-half")


def test_the_conformance_judge_passes_an_exported_adapter(impl, exported):
    """``--judge`` adds the conformance suites' own verdict (``dsv4_conformance.judge``) as a row of its own."""
    result = impl.verify_adapter(*exported, judge=True)
    row = next((c for c in result.checks if c.name == "conformance"), None)
    assert row is not None and row.passed, f"the judge's row: {row}; problems: {result.problems}"


@pytest.mark.parametrize("case", JUDGED)
def test_the_conformance_judge_fails_a_spoilt_adapter(impl, exported, tmp_path, case):
    tamper, _ = TAMPER[case]
    base, adapter = edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter, judge=True)
    row = next((c for c in result.checks if c.name == "conformance"), None)
    assert row is not None and row.passed is False, f"{case}: the judge's row passed a spoilt adapter: {row}"


def test_each_check_row_says_what_it_found_on_a_sound_adapter(impl, exported):
    """The rows a user reads for a passing adapter: how many files the marker certifies, the LoRA's r and alpha, the
    modules and their dialect, and by how many tensors' every byte the base was matched."""
    base, adapter = exported
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        fingerprinted = len(json.loads(f.metadata()["dsv4_base_fingerprint"])["tensors"])
    modules = 5 * get_preset(PRESET).num_hidden_layers  # the five main targets of every layer
    rows = {c.name: c.figure for c in impl.verify_adapter(base, adapter).checks}
    want = {
        "marker": "certifies 2 files",
        "config": f"LoRA r={R} alpha={ALPHA}",
        "names": f"{modules} modules, dialect transformers",
        "fingerprint": f"matches the base (every byte of {fingerprinted} tensors)",
        "shapes": "agree with r and the base",
        "provenance": "certified: .complete and base fingerprint recorded",
    }
    assert {name: rows.get(name) for name in want} == want, f"the check rows: {rows}"


def test_the_fingerprint_row_says_not_checked_when_the_base_cannot_be_read(impl, exported, tmp_path):
    base, adapter = edited_copies(exported, tmp_path, lambda adapter, base: (base / "config.json").unlink())
    rows = {c.name: c.figure for c in impl.verify_adapter(base, adapter).checks}
    assert rows.get("fingerprint") == "not checked (no base given)", f"the check rows: {rows}"


def test_with_a_base_validate_adapter_dir_requires_certification_unless_told_not_to(impl, exported, tmp_path):
    """The library's check against a base refuses an adapter that cannot prove it was trained on it, by default."""
    base, adapter = edited_copies(exported, tmp_path, lambda adapter, base: (adapter / ".complete").unlink())
    with pytest.raises(impl.AdapterValidationError, match="uncertified"):
        impl.validate_adapter_dir(adapter, base=base, require_complete=False)
    impl.validate_adapter_dir(adapter, base=base, require_complete=False, require_certified=False)


#: what the fingerprint's metadata entry holds instead of a fingerprint -> how the problem line ends
NO_FINGERPRINT = {
    "no-json": ("{tensors", "unreadable base fingerprint metadata"),
    "no-digest": (
        json.dumps({"tensors": {"layers.0.attn.wq_a.weight": {"shape": [1]}}}),
        "the base fingerprint metadata is not a dsv4-lora fingerprint",
    ),
}


@pytest.mark.parametrize("case", sorted(NO_FINGERPRINT))
def test_a_fingerprint_entry_that_is_no_fingerprint_is_named_as_such(impl, exported, tmp_path, case):
    """Metadata under the fingerprint's key that is not JSON, or lacks a tensor's shape, dtype or digest, is not
    compared (it proves nothing): it is named as what it is."""
    entry, says = NO_FINGERPRINT[case]

    def spoil(adapter, base):
        file = adapter / "adapter_model.safetensors"
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, file, metadata={**metadata, "dsv4_base_fingerprint": entry})

    base, adapter = edited_copies(exported, tmp_path, spoil)
    problems = impl.verify_adapter(base, adapter).problems
    assert any(says in p for p in problems), f"{case}: not named: {problems}"
    assert not any(UNCHECKED in p for p in problems), f"{case}: a check stumbled over it: {problems}"


def test_the_fingerprint_row_says_which_weights_were_compared_by_their_sampled_pages(impl, tmp_path, monkeypatch):
    """A large weight whose digest is not remembered is compared by its sampled pages, and the row says how many
    were (``--full-hash``: every byte of every one)."""
    monkeypatch.setenv("DSV4_LORA_CACHE", "off")  # nothing remembered from an earlier run
    config = get_preset(PRESET)
    config.q_lora_rank = SAMPLED_ABOVE // (4 * config.hidden_size) + 1  # fp32 wq_a [q_lora, hidden] and wq_b: large
    base = write_checkpoint(config, tmp_path / "base", seed=2)
    adapter = export_fingerprinted_adapter(impl, base, tmp_path / "adapter", config, r=R, alpha=ALPHA)
    layers = config.num_hidden_layers

    def row(**options):
        return next(c.figure for c in impl.verify_adapter(base, adapter, **options).checks if c.name == "fingerprint")

    sampled = re.fullmatch(r"matches the base \((\d+) tensors by every byte, (\d+) by \d+ sampled pages: .*\)", row())
    assert sampled and sampled.groups() == (str(3 * layers), str(2 * layers)), f"the sampled row: {row()}"
    assert row(full_hash=True) == f"matches the base (every byte of {5 * layers} tensors)"


def test_an_unreadable_fingerprint_entry_beside_an_unreadable_base_gets_a_verdict(impl, exported, tmp_path):
    """No base to compare with and a fingerprint entry that is not JSON: verify-adapter still answers, and its
    fingerprint row claims no match."""

    def spoil(adapter, base):
        (base / "config.json").unlink()
        file = adapter / "adapter_model.safetensors"
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, file, metadata={**metadata, "dsv4_base_fingerprint": "{tensors"})

    base, adapter = edited_copies(exported, tmp_path, spoil)
    result = impl.verify_adapter(base, adapter)
    rows = {c.name: c.figure for c in result.checks}
    assert not result.ok and "matches" not in rows.get("fingerprint", ""), (result.problems, rows)


def test_the_library_check_compares_every_byte_of_a_large_base_weight(impl, tmp_path, monkeypatch):
    """docs/fingerprint.md: the library functions (the export's check among them) compare every byte, so a change
    between the pages a sample would read (a flipped bit on disk) is refused, naming the weight."""
    monkeypatch.setenv("DSV4_LORA_CACHE", "off")  # nothing remembered from an earlier run
    config = get_preset(PRESET)
    config.q_lora_rank = 2 * SAMPLED_ABOVE // (4 * config.hidden_size)  # fp32 wq_a [q_lora, hidden]: 128 pages
    base = write_checkpoint(config, tmp_path / "base", seed=2)
    adapter = export_fingerprinted_adapter(impl, base, tmp_path / "adapter", config, r=R, alpha=ALPHA)
    official = "layers.0.attn.wq_a.weight"
    (shard,) = base.glob("*.safetensors")
    tensors = load_file(shard)
    flat = tensors[official].view(-1)
    n = flat.numel() * flat.element_size()
    between = (4096 + (n - 4096) // 63) // 2  # past the first sampled page, before the second (docs/fingerprint.md)
    flat[between // flat.element_size()] += 1.0
    save_file(tensors, shard)
    with pytest.raises(impl.FingerprintMismatchError, match=re.escape(official)):
        impl.validate_adapter_dir(adapter, base=base)


def test_an_unreadable_fingerprint_certifies_nothing_even_without_a_base(impl, exported, tmp_path):
    """A fingerprint entry that is no JSON proves no base: with no base to check it against, an adapter whose
    ``.complete`` certifies those very bytes is still uncertified, so a caller who requires certification is
    refused, naming the fingerprint."""
    import hashlib
    import json

    def spoil(adapter, base):
        file = adapter / "adapter_model.safetensors"
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, file, metadata={**metadata, "dsv4_base_fingerprint": "{tensors"})
        marker = json.loads((adapter / ".complete").read_text())
        marker["files"] = {n: hashlib.sha256((adapter / n).read_bytes()).hexdigest() for n in marker["files"]}
        (adapter / ".complete").write_text(json.dumps(marker))

    _, adapter = edited_copies(exported, tmp_path, spoil)
    impl.validate_adapter_dir(adapter, require_certified=False)  # the bytes are the certified ones
    with pytest.raises(impl.AdapterValidationError, match="unreadable base fingerprint"):
        impl.validate_adapter_dir(adapter, require_certified=True)


_FORWARD = re.compile(
    r"max\|Δ\| merged (?P<merged>\S+), unmerged (?P<unmerged>\S+) \(tol (?P<tol>\S+)\); the adapter moves them by "
    r"(?P<effect>\S+)$"
)


def test_the_forward_check_reloads_an_exported_adapter_within_the_rule_and_says_its_delta_is_visible(impl, exported):
    """``forward``: PEFT's merged and unmerged reloads equal the base with ``W + s·B@A`` within the judge's rule, and
    the adapter moves the logits by more than that tolerance (else equal logits would prove nothing); the judge's
    own verdict is its row, passing."""
    base, adapter = exported
    result = impl.verify_adapter(base, adapter, forward=True)
    rows = {c.name: c for c in result.checks}
    assert result.ok and not result.problems, result.problems
    assert all(c.passed is True for c in result.checks), [(c.name, c.passed) for c in result.checks]
    assert [c.name for c in result.checks if c.status is not None] == ["provenance"], result.checks
    assert re.fullmatch(r"DeepSeek-V4, \d+ tensors in \d+ shard\(s\)", rows["base"].figure), rows["base"].figure
    forward = rows["forward"]
    found = _FORWARD.search(forward.figure)
    assert forward.passed is True and found, forward.figure
    merged, unmerged, tol, effect = (float(found[k]) for k in ("merged", "unmerged", "tol", "effect"))
    assert max(merged, unmerged) <= tol < effect, forward.figure


def test_an_adapter_that_moves_nothing_is_inconclusive_in_the_forward_check_not_passed(impl, exported, tmp_path):
    """All ``lora_B`` zero (an untrained adapter): the reload equals the base, which proves nothing about the delta,
    so the forward row says inconclusive rather than passed."""

    def untrain(adapter, base):
        file = adapter / "adapter_model.safetensors"
        tensors = {k: (v.zero_() if ".lora_B." in k else v) for k, v in load_file(str(file)).items()}
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
        save_file(tensors, file, metadata=metadata)
        (adapter / ".complete").unlink()

    base, adapter = edited_copies(exported, tmp_path, untrain)
    result = impl.verify_adapter(base, adapter, forward=True)
    rows = {c.name: c for c in result.checks}
    assert rows["forward"].passed is None and rows["forward"].figure.startswith("inconclusive"), rows["forward"]
    assert result.ok and result.uncertified is not None, "an inconclusive row fails nothing; no .complete: uncertified"


def test_a_refused_strict_result_still_answers_whether_it_is_uncertified(impl, exported, tmp_path):
    """No ``.complete``: without certification required the adapter passes and ``uncertified`` says why; with it
    required the provenance row fails, and ``uncertified`` can still be read off the refused result: None, since a
    failed row is a refusal, not an uncertified pass (it never raises)."""
    base, adapter = edited_copies(exported, tmp_path, lambda adapter, base: (adapter / ".complete").unlink())
    lenient = impl.verify_adapter(base, adapter)
    assert lenient.ok and lenient.uncertified and ".complete" in lenient.uncertified, lenient.uncertified
    strict = impl.verify_adapter(base, adapter, require_certified=True)
    row = next(c for c in strict.checks if c.name == "provenance")
    assert not strict.ok and row.passed is False, (strict.problems, row)
    assert strict.uncertified is None, f"a refused provenance row reads as uncertified: {strict.uncertified!r}"


@pytest.mark.parametrize("case", JUDGED)
def test_the_judges_problems_are_not_listed_again_beside_the_checks_own(impl, exported, tmp_path, case):
    """Where the checks above the judge found problems, the judge's are the same causes seen twice: its row fails,
    quoting one, and the problem list holds no ``conformance:`` line."""
    tamper, _ = TAMPER[case]
    base, adapter = edited_copies(exported, tmp_path, tamper)
    result = impl.verify_adapter(base, adapter, judge=True)
    row = next(c for c in result.checks if c.name == "conformance")
    assert row.passed is False and ", e.g. " in row.figure, f"{case}: the judge's row: {row}"
    repeated = [p for p in result.problems if p.startswith("conformance:")]
    assert not repeated, f"{case}: the judge's problems listed again: {repeated}"


def _also_targeting_the_q_norms(adapter, base):
    """An edit for :func:`edited_copies`: ``target_modules`` also reaches every layer's ``q_a_norm`` (which holds no
    adapter tensor), uncertified as :func:`with_config` leaves it."""
    file = adapter / "adapter_config.json"
    config = json.loads(file.read_text())
    wanted = config["target_modules"]
    either = f"(?:{wanted})|(?:.*\\.q_a_norm)" if isinstance(wanted, str) else [*wanted, "q_a_norm"]
    with_config(target_modules=either)(adapter, base)


def test_a_problem_only_the_conformance_judge_sees_is_listed_and_fails_its_row(impl, exported, tmp_path):
    """A ``target_modules`` that also reaches a norm passes the checks above the judge (a norm holds no matrix, so
    no adapter tensor is missing for it); PEFT refuses to wrap it, and the judge says so: its row fails and its
    problem is listed, prefixed ``conformance:``."""
    base, adapter = edited_copies(exported, tmp_path, _also_targeting_the_q_norms)
    result = impl.verify_adapter(base, adapter, judge=True)
    row = next(c for c in result.checks if c.name == "conformance")
    listed = [p for p in result.problems if p.startswith("conformance:") and "q_a_norm" in p]
    assert row.passed is False and not result.ok, f"the judge's row passed a target_modules reaching a norm: {row}"
    assert listed, f"the judge's problem is not listed: {result.problems}"


def test_the_judge_reads_a_json_true_as_no_rank_and_no_alpha(exported, tmp_path):
    """``true`` is no number, though Python counts it as 1: the judge names ``r`` and ``lora_alpha`` each; the
    control, the exported adapter as it is, passes."""
    from dsv4_conformance.judge.artifacts import judge_adapter_dir

    assert judge_adapter_dir(exported[1], exported[0]) == [], "the control: the export as it is"
    base, adapter = edited_copies(exported, tmp_path, with_config(r=True, lora_alpha=True))
    problems = [str(p) for p in judge_adapter_dir(adapter, base)]
    for field in ("r is True, not a positive integer", "lora_alpha is True, not a positive number"):
        assert any(field in p for p in problems), f"{field!r} not among {problems}"


def test_an_adapter_peft_refuses_to_load_fails_the_forward_check_naming_peft_s_reason(impl, exported, tmp_path):
    """``layers_to_transform`` beside a regular-expression ``target_modules``: every file check passes, PEFT refuses
    to load it. The forward check cannot run; that is a finding, never an exception: its row fails and the problem
    says why."""
    base, adapter = edited_copies(exported, tmp_path, with_config(layers_to_transform=[0]))
    result = impl.verify_adapter(base, adapter, forward=True)
    row = next(c for c in result.checks if c.name == "forward")
    said = [p for p in result.problems if "forward check could not run" in p and "layers_to_transform" in p]
    assert row.passed is False and not result.ok, f"the forward row of an adapter PEFT refuses: {row}"
    assert said, f"PEFT's refusal is not named: {result.problems}"


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_peft_reloads_onto_a_rewritten_base_fails_the_forward_check_naming_each_reload(
    impl, exported, tmp_path, init
):
    """A PiSSA / OLoRA adapter saved unconverted: PEFT's reload subtracts its initial delta from the base weights, so
    neither reload is ``W + s*B@A`` though every file check passes. The forward row fails and each reload's difference
    is a problem of its own."""
    base, adapter = edited_copies(exported, tmp_path, with_config(init_lora_weights=init))
    result = impl.verify_adapter(base, adapter, forward=True)
    row = next(c for c in result.checks if c.name == "forward")
    assert row.passed is False and not result.ok, f"{init}: the forward row passed a rewritten base: {row}"
    for mode in ("merged", "unmerged"):
        said = [p for p in result.problems if p.startswith(f"forward: PEFT {mode} logits differ from W + s*B@A")]
        assert said, f"{init}: the {mode} reload's difference is not listed: {result.problems}"


def test_an_adapter_whose_delta_overflows_float32_fails_the_forward_check(impl, exported, tmp_path):
    """Finite LoRA halves of 1e30 pass every file check, but ``s*B@A`` is infinite in float32 and the logits are not
    numbers: no comparison holds, so the forward row fails and the adapter with it."""

    def overflow(adapter, base):
        file = adapter / "adapter_model.safetensors"
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
        save_file({k: v.fill_(1e30) for k, v in load_file(str(file)).items()}, file, metadata=metadata)
        (adapter / ".complete").unlink()

    base, adapter = edited_copies(exported, tmp_path, overflow)
    result = impl.verify_adapter(base, adapter, forward=True)
    row = next(c for c in result.checks if c.name == "forward")
    assert row.passed is False, f"the forward row of an overflowing adapter: {row}"
    assert not result.ok, f"an adapter whose logits are NaN passed: {row}"
    listed = [p for p in result.problems if p.startswith("forward: PEFT merged logits differ")]
    assert listed, f"the NaN comparison is not listed among the problems: {result.problems}"


def test_the_forward_check_runs_on_a_base_of_a_small_vocabulary(impl, tmp_path):
    """The forward check's batch of token ids is drawn from the base's own vocabulary, however small: on a 16-token
    base it runs and the exported adapter passes."""
    config = get_preset(PRESET)
    config.vocab_size = 16
    base = write_checkpoint(config, tmp_path / "base", seed=2)
    adapter = export_fingerprinted_adapter(impl, base, tmp_path / "adapter", config, r=R, alpha=ALPHA)
    result = impl.verify_adapter(base, adapter, forward=True)
    row = next(c for c in result.checks if c.name == "forward")
    assert result.ok and row.passed is not False, (row, result.problems)

"""``dsv4-lora verify-adapter --consumer`` and ``dsv4-lora export --consumer``, run as a user runs them (subprocesses).

verify-adapter lists every target the consumer would not apply (a problem line naming consumer, version,
dialect, target, status and the consumer's reason) and exits 1; it exits 0 when the consumer applies all of them.
export re-publishes an adapter for a consumer and fails closed (exit 1, nothing at ``--out``) unless
``--allow-unapplied``. ``--consumer vllm==RELEASE`` names the release; without one the newest release a lane tested
judges, and the command says which. Expected verdicts are each release's own (``suites/reference/test_consumers.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter
from fixtures.runner.subproc import cli_runner
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset

pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group("cli")]

R, ALPHA = 4, 8.0
ALL = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
VLLM_APPLIES = ("wq_a", "wq_b", "wkv", "wo_b")  # 0.33 on every LoRA platform; 0.34 on XPU
OLD, NEW = "vllm==0.33.0", "vllm==0.34.0"


@pytest.fixture(scope="module")
def dsv4(impl):
    """Run the implementation's command line (``python -m <impl>.cli``)."""
    return cli_runner(impl.name, timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_checkpoint("tiny-mixed", tmp_path_factory.mktemp("consumer-cli") / "base", seed=2)


@pytest.fixture(scope="module")
def export(impl, base, tmp_path_factory):
    """Export the given targets in a dialect against the tiny base (fingerprinted): the adapter's directory."""
    cfg = get_preset("tiny-mixed")
    shapes = config_attention_shapes(cfg)
    layers = cfg.num_hidden_layers
    names = [f"layers.{i}.attn.{leaf}.weight" for i in range(layers) for leaf in shapes]
    fingerprint = impl.base_fingerprint(base, names)
    root = tmp_path_factory.mktemp("adapters")

    def make(dialect: str, targets: tuple[str, ...]) -> Path:
        out = root / f"{dialect}-{'-'.join(targets)}"
        state = impl.AdapterState(make_native_adapter({t: shapes[t] for t in targets}, layers, R), r=R, alpha=ALPHA)
        impl.export_adapter(state, out, dialect=dialect, base_fingerprint=fingerprint)
        return out

    return make


def _problems(result) -> list[str]:
    return [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("problem: consumer:")]


def test_verify_lists_wo_a_as_what_vllm_loads_but_never_applies(dsv4, base, export):
    adapter = export("official", ALL)
    result = dsv4("verify-adapter", "--base", base, "--adapter", adapter, "--consumer", OLD)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    problems = _problems(result)
    assert len(problems) == 2, "\n".join(problems)
    for platform, kernel in (("vllm/nvidia", "deep_gemm_fp8_o_proj"), ("vllm/xpu", "_o_proj")):
        line = next((p for p in problems if f"{platform} 0.33.0 (official dialect): wo_a:" in p), None)
        assert line is not None and "loaded_not_applied" in line and kernel in line, "\n".join(problems)


def test_verify_passes_an_adapter_vllm_applies_entirely(dsv4, base, export):
    adapter = export("official", VLLM_APPLIES)
    result = dsv4("verify-adapter", "--base", base, "--adapter", adapter, "--consumer", "vllm")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "4/4 target(s) applied" in result.stdout, result.stdout[-3000:]
    said = " ".join(result.stdout.split())  # the table wraps long cells
    assert "vllm 0.34.0 (the newest tested release; tested: 0.33.0, 0.34.0" in said, result.stdout[-3000:]


def test_vllm_0_34_applies_all_five_on_nvidia_and_an_untested_release_is_refused(dsv4, export, tmp_path):
    """vLLM 0.34's NVIDIA model applies wo_a: the five-target adapter exports for vllm/nvidia==0.34.0 (for
    vllm==0.34.0, both LoRA platforms, XPU's unapplied wo_a refuses it, and the refusal names the platform that
    applies all five; for 0.33.0 both refuse); a release no lane ran is one typed error line listing the tested
    ones."""
    src = export("transformers", ALL)
    done = dsv4("export", "--adapter", src, "--out", tmp_path / "nvidia", "--consumer", "vllm/nvidia==0.34.0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "for vllm/nvidia 0.34.0 (official dialect)" in done.stdout, done.stdout[-2000:]
    refused = dsv4("export", "--adapter", src, "--out", tmp_path / "both", "--consumer", NEW)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "vllm/xpu 0.34.0 (official dialect): wo_a: loaded_not_applied" in said, said
    assert "vllm/nvidia 0.34.0 (official dialect): wo_a" not in said, said[-3000:]
    # the way forward for a user who serves on NVIDIA only, named; 0.33 has no platform that applies all five
    assert "vllm/nvidia 0.34.0 applies every target" in said and "--consumer vllm/nvidia==0.34.0" in said, said
    old = dsv4("export", "--adapter", src, "--out", tmp_path / "old", "--consumer", OLD)
    assert old.returncode == 1 and "applies every target" not in old.stdout + old.stderr, old.stdout[-3000:]
    untested = dsv4("export", "--adapter", src, "--out", tmp_path / "new", "--consumer", "vllm==0.35.0")
    said = untested.stdout + untested.stderr
    assert untested.returncode == 1 and "Traceback" not in said, said[-3000:]
    assert "ConsumerSupportError" in said and "['0.33.0', '0.34.0']" in said, said[-3000:]
    assert not any((tmp_path / name).exists() for name in ("both", "old", "new"))


def test_verify_lists_every_target_sglang_refuses(dsv4, base, export):
    adapter = export("sglang", ALL)
    result = dsv4("verify-adapter", "--base", base, "--adapter", adapter, "--consumer", "sglang")
    assert result.returncode == 1, result.stdout[-3000:]
    problems = "\n".join(_problems(result))
    for target in ("(adapter)", *ALL):
        assert f"sglang 0.5.23 (sglang dialect): {target}: rejected" in problems, problems
    assert "wq_b: rejected -> indexer.wq_b" in problems, problems


@pytest.mark.parametrize("consumer, code", [("peft", 0), (OLD, 1)])
def test_verify_judges_a_transformers_adapter_per_consumer(dsv4, base, export, consumer, code):
    adapter = export("transformers", ALL)
    result = dsv4("verify-adapter", "--base", base, "--adapter", adapter, "--consumer", consumer)
    assert result.returncode == code, result.stdout[-3000:]
    if consumer == OLD:  # one cause (the naming), one line, and the command that re-publishes it
        problems = _problems(result)
        assert len(problems) == 2, "\n".join(problems)
        assert "vllm/nvidia, vllm/xpu 0.33.0 (transformers dialect): 6 targets rejected" in problems[0], problems[0]
        assert "dsv4-lora export --adapter" in problems[1] and f"--consumer {OLD}" in problems[1], problems[1]


def test_export_for_vllm_fails_closed_and_writes_nothing(dsv4, export, tmp_path):
    out = tmp_path / "for-vllm"
    result = dsv4("export", "--adapter", export("transformers", ALL), "--out", out, "--consumer", OLD)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert "ConsumerSupportError" in said and "vllm/nvidia 0.33.0 (official dialect): wo_a" in said, said[-3000:]
    assert not out.exists() and not list(tmp_path.iterdir()), f"a refused export left {list(tmp_path.iterdir())}"


def test_export_allow_unapplied_records_the_targets_and_verify_still_lists_them(dsv4, base, export, tmp_path):
    out = tmp_path / "for-vllm"
    src = export("transformers", ALL)
    result = dsv4("export", "--adapter", src, "--out", out, "--consumer", OLD, "--allow-unapplied")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert (out / ".complete").is_file()
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        meta = f.metadata() or {}
    record = json.loads(meta["dsv4_consumer"])
    assert meta["dsv4_dialect"] == "official" and "dsv4_base_fingerprint" in meta, sorted(meta)
    assert {(u["engine"], u["target"]) for u in record["unapplied"]} == {("vllm/nvidia", "wo_a"), ("vllm/xpu", "wo_a")}
    checked = dsv4("verify-adapter", "--base", base, "--adapter", out, "--consumer", OLD)
    assert checked.returncode == 1 and len(_problems(checked)) == 2, checked.stdout[-3000:]


def test_export_has_help_naming_the_consumers(dsv4):
    result = dsv4("export", "--help", timeout=120)
    assert result.returncode == 0 and "usage: dsv4-lora export" in result.stdout, result.stderr[-2000:]
    for consumer in ("peft", "vllm", "sglang"):
        assert consumer in result.stdout, result.stdout

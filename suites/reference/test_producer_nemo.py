"""NeMo AutoModel's adapters, made by its own released code and judged by ``verify-adapter``.

NeMo AutoModel 0.7.0 (its own environment: ``scripts/install_consumers.sh nemo-automodel``) builds its
``DeepseekV4ForCausalLM`` from the base's ``config.json``, wraps what its module matcher selects, trains one step and
saves with its own ``Checkpointer`` (``fixtures/consumers/produce_nemo_automodel.py``). Its V4-Flash LoRA recipe's
globs ``*wq_a *wq_b *wkv *wo_b`` also match the indexer's and the compressors' linears (the seed's ``wq_b`` hazard, in
a third producer): ``verify-adapter`` must say so, one line per cause naming an example, and pass the same producer's
adapter when the globs are qualified by ``self_attn.``. Skipped without the environment; CI
(``DSV4_REQUIRE_CONSUMERS=1``) fails instead."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from fixtures.consumers import HERE, PRODUCERS, require_consumer_env, run_probe_script
from fixtures.runner.subproc import run
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import CSA, HCA, tiny_config

# slow: its time is starting NeMo AutoModel's interpreter (no Bridge pin or lane changes what it runs)
pytestmark = [pytest.mark.cpu, pytest.mark.slow, pytest.mark.xdist_group("nemo-automodel")]

RECIPE = "*wq_a,*wq_b,*wkv,*wo_b"
QUALIFIED = "*self_attn.wq_a,*self_attn.wq_b,*self_attn.wkv,*self_attn.wo_b"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny base with one compressed-sparse (indexer) and one heavily compressed layer."""
    cfg = tiny_config(
        layer_types=[CSA, HCA], num_hash_layers=0, hca_rate=128, vocab_size=128, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8, q_lora_rank=32,
        o_lora_rank=16, o_groups=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=32, index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
    )  # fmt: skip
    return write_checkpoint(cfg, tmp_path_factory.mktemp("nemo") / "base")


@pytest.fixture(scope="module")
def made(base, tmp_path_factory) -> dict:
    """Both specs' adapters, made in one run of the producer (importing NeMo AutoModel is most of its time)."""
    require_consumer_env("nemo-automodel")
    out = tmp_path_factory.mktemp("nemo-adapters")
    report = out / "report.json"
    args = ["--base", str(base), "--out", str(out), "--report", str(report)]
    args += [a for name, globs in (("recipe", RECIPE), ("qualified", QUALIFIED)) for a in ("--spec", f"{name}={globs}")]
    run_probe_script("nemo-automodel", HERE / PRODUCERS["nemo-automodel"], args, timeout_s=600)
    found = json.loads(report.read_text())
    return {name: {"version": found["version"], **spec} for name, spec in found["specs"].items()}


def _doc_row(spec: str) -> str:
    """docs/producers.md's row for ``spec`` (its target-spec cell holds the spec's first glob)."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "producers.md"
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| NeMo AutoModel |") and spec in line]
    assert len(rows) == 1, f"docs/producers.md: expected one NeMo AutoModel row with {spec!r}, found {rows}"
    return rows[0]


def _assert_documented(spec: str, made: dict, verdict: str) -> None:
    cells = [c.strip() for c in _doc_row(spec).strip("|").split("|")]
    want = {"version": made["version"], "wraps": f"{len(made['matched'])}:", "verify-adapter": verdict}
    got = {"version": cells[1], "wraps": cells[3].split()[0], "verify-adapter": cells[4].split(":")[0]}
    assert got == want, f"docs/producers.md's NeMo AutoModel row for {spec!r} is stale: says {got}, found {want}"


def _verify(impl, base: Path, adapter: str):
    argv = [sys.executable, "-m", f"{impl.name}.cli", "verify-adapter", "--base", str(base), "--adapter", adapter]
    return run(argv, timeout=300)


def test_the_recipes_globs_wrap_the_indexer_and_compressors_and_verify_names_each_cause_once(impl, base, made):
    made = made["recipe"]
    nested = sorted(m for m in made["matched"] if ".compressor." in m)
    assert nested, f"NeMo AutoModel {made['version']}'s matcher took no nested module: {made['matched']}"
    done = _verify(impl, base, made["adapter"])
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    problems = [line for line in said.splitlines() if line.strip().startswith("problem:")]
    for kind, example in (("indexer", "compressor.indexer."), ("compressor", "compressor.kv_proj")):
        lines = [p for p in problems if re.search(rf"\b{kind} modules?\b", p.split("(")[0])]
        assert len(lines) == 1, f"{kind}: expected one problem line, got {lines} (all: {problems})"
        assert example in lines[0], f"{kind}: the line names no example ({example}): {lines[0]}"
    assert len(problems) == 2, f"expected the two causes only: {problems}"
    _assert_documented("`*wq_a *wq_b *wkv *wo_b`", made, "fails")


def test_the_same_producer_with_qualified_globs_passes_uncertified(impl, base, made):
    made = made["qualified"]
    assert made["matched"] and not [m for m in made["matched"] if ".compressor." in m], made["matched"]
    done = _verify(impl, base, made["adapter"])
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "UNCERTIFIED" in said, said
    assert f"{len(made['matched'])} modules" in said, said
    _assert_documented("`*self_attn.wq_a", made, "passes, uncertified")

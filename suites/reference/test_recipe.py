"""The DeepSeek-V4-Flash LoRA recipe: a runnable 32-GPU layout, the generated pipeline layout, the
hardware gate evaluated when the recipe is built, typed rejection of layouts that cannot run, and a tiny twin
that drives ``dsv4-lora qualify`` end to end on 2 CPU ranks. Also: the launch scripts parse, and the GPU suites
collect (and skip with the CUDA reason) on a CPU host."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import sys
import time

import pytest
import torch

from fixtures.data.simulated_accelerators import simulate_dsa_kernels
from fixtures.runner.subproc import REPO_ROOT, run
from tiny_models.presets import flash_config, get_preset, min_seq_len

pytestmark = pytest.mark.cpu

RECIPES = REPO_ROOT / "recipes"
FIVE = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
QUALIFY_CHECKS = ["detect", "targets", "load", "base_logits", "train", "export", "reload"]  # test_cli.py


def _hash_prefix(hf_config) -> int:
    types = hf_config.mlp_layer_types
    return next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))


def _assert_layout_properties(layout, *, num_layers: int, num_hash: int, mtp: int, stages: int, who: str) -> None:
    decoders = [stage.count("decoder") for stage in layout]
    assert len(layout) == stages, f"{who}: {len(layout)} stages, want {stages}"
    assert layout[0][0] == "embedding" and sum(s.count("embedding") for s in layout) == 1, f"{who}: {layout[0]}"
    assert decoders[0] >= num_hash, f"{who}: stage 0 has {decoders[0]} decoders but {num_hash} hash layers"
    tail = ("mtp",) * mtp + ("loss",)
    assert layout[-1][-len(tail) :] == tail, f"{who}: last stage ends {layout[-1][-len(tail) :]}, want {tail}"
    assert all(s.count("mtp") == 0 and "loss" not in s for s in layout[:-1]), f"{who}: mtp/loss before last stage"
    assert sum(decoders) == num_layers and min(decoders) >= 1, f"{who}: decoders per stage {decoders}"
    assert max(decoders) - min(decoders) <= 1, f"{who}: unbalanced decoders per stage {decoders}"


# ------------------------------------------------------------------------------------------ the Flash recipe


def test_flash_recipe_is_the_upstream_sft_layout_on_32_gpus(impl):
    recipe = impl.deepseek_v4_flash_lora_recipe()
    assert (recipe.nodes, recipe.gpus_per_node, recipe.world_size) == (4, 8, 32)
    assert (recipe.tp, recipe.pp, recipe.ep, recipe.vpp) == (1, 4, 8, None), "upstream SFT: TP=1 PP=4 EP=8"
    assert recipe.data_parallel_size == 32 // (1 * 4), f"DP {recipe.data_parallel_size}"
    assert recipe.moe_token_dispatcher_type == "alltoall"
    # LoRA recomputes whole layers (the memory table in recipes/deepseek_v4_flash_lora.md shows why)
    plan = recipe.activation_plan()
    assert (plan["recompute_granularity"], plan["recompute_method"], plan["recompute_num_layers"]) == (
        "full",
        "uniform",
        1,
    ), plan
    impl.ActivationPlan(**plan)  # a plan the native layers accept
    dp_batch = recipe.micro_batch_size * recipe.data_parallel_size
    assert recipe.global_batch_size % dp_batch == 0, f"global batch {recipe.global_batch_size} vs {dp_batch}"


def test_flash_recipe_model_facts_match_the_published_flash_config(impl):
    model, cfg = impl.deepseek_v4_flash_lora_recipe().model, flash_config()
    got = (model.num_layers, model.num_hash_layers, model.mtp_layers, model.num_experts, model.num_heads)
    want = (cfg.num_hidden_layers, _hash_prefix(cfg), cfg.num_nextn_predict_layers, cfg.n_routed_experts, 64)
    assert got == want == (43, 3, 1, 256, 64), f"recipe model {got} vs flash_config {want}"
    assert model.num_experts % impl.deepseek_v4_flash_lora_recipe().ep == 0


def test_flash_recipe_pipeline_layout_is_generated_with_hash_layers_first_and_mtp_last(impl):
    recipe = impl.deepseek_v4_flash_lora_recipe()
    _assert_layout_properties(recipe.pipeline_layout, num_layers=43, num_hash=3, mtp=1, stages=4, who="flash pp4")
    assert recipe.pipeline_layout == impl.generate_pipeline_layout(43, 4, num_hash_layers=3, mtp_layers=1)
    assert impl.resolve_pipeline_layout(None, num_layers=43, stages=4, num_hash_layers=3, mtp_layers=1) == (
        recipe.pipeline_layout
    ), "a run configuration that lost the layout must regenerate the recipe's layout"


def test_flash_recipe_virtual_pipeline_layout_covers_every_virtual_stage(impl):
    recipe = impl.deepseek_v4_flash_lora_recipe(vpp=2)
    _assert_layout_properties(recipe.pipeline_layout, num_layers=43, num_hash=3, mtp=1, stages=8, who="pp4 vpp2")


def test_flash_recipe_lora_and_optimizer_settings(impl):
    recipe = impl.deepseek_v4_flash_lora_recipe()
    assert recipe.targets == FIVE
    assert (recipe.lora_rank, recipe.lora_alpha, recipe.lora_dropout) == (16, 32.0, 0.05)
    opt = recipe.optimizer
    assert (opt.name, opt.lr, opt.weight_decay, opt.clip_grad, opt.bf16) == ("adam", 1e-4, 0.0, 1.0, True)
    assert 0 < opt.lr_warmup_iters < opt.train_iters and opt.min_lr < opt.lr


def test_flash_recipe_reads_its_checkpoint_from_the_environment(impl, monkeypatch, tmp_path):
    monkeypatch.delenv("DSV4_FLASH_CHECKPOINT", raising=False)
    assert impl.deepseek_v4_flash_lora_recipe().checkpoint is None
    monkeypatch.setenv("DSV4_FLASH_CHECKPOINT", str(tmp_path))
    assert impl.deepseek_v4_flash_lora_recipe().checkpoint == str(tmp_path)


@pytest.mark.parametrize(
    ("cuda", "major", "fused"),
    [(False, None, False), (True, 9, False), (True, 10, True), (True, 12, True)],
    ids=["no-cuda", "hopper-sm90", "blackwell-sm100", "blackwell-sm120"],
)
def test_fused_kernel_defaults_follow_the_hardware_gate_when_the_recipe_is_built(impl, monkeypatch, cuda, major, fused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))
    simulate_dsa_kernels(monkeypatch, installed=True)  # DSA fusion also needs its packages (test_detection.py)
    recipe = impl.deepseek_v4_flash_lora_recipe()
    got = (recipe.fused.use_fused_mhc, recipe.fused.apply_dsa_kernel_fusion)
    # DSA stays unfused on every host, as in upstream's Flash SFT recipes (suites/reference/test_recipe_upstream_sft.py)
    assert got == (fused, False), f"cuda={cuda} capability major={major}: fused defaults {got}, want {fused}"
    assert recipe.fused.use_fused_mhc == impl.fused_kernel_defaults().use_fused_mhc
    assert impl.tiny_variant(recipe).fused == recipe.fused, "the tiny variant must apply the same gate"


# ------------------------------------------------------------------------------------------ rejection


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nodes": 3}, r"world size 24 is not divisible by PP\*EP=32"),
        ({"gpus_per_node": 6, "pp": 4, "ep": 1, "tp": 4}, r"world size 24 .* not divisible by TP\*PP=16"),
        ({"nodes": 3, "gpus_per_node": 4, "ep": 3}, r"EP=3 does not divide the 256 routed experts"),
        ({"tp": 3, "nodes": 3, "gpus_per_node": 4, "pp": 4, "ep": 1}, r"TP=3 must divide num_heads=64"),
        ({"pp": 0}, r"parallel sizes must be >= 1"),
    ],
    ids=["world-vs-ep", "world-vs-tp-pp", "ep-vs-experts", "tp-vs-heads", "zero-pp"],
)
def test_parallel_layouts_that_cannot_run_are_rejected(impl, kwargs, match):
    with pytest.raises(impl.UnsupportedConfigError, match=match):
        impl.deepseek_v4_flash_lora_recipe(**kwargs)


@pytest.mark.parametrize(
    ("pp", "match"), [(44, r"44 pipeline stages for 43 decoder layers"), (42, r"3 hash-routed layers must all sit")]
)
def test_pipeline_depths_the_flash_layout_cannot_hold_are_rejected(impl, pp, match):
    with pytest.raises(impl.PipelineLayoutError, match=match):
        impl.deepseek_v4_flash_lora_recipe(nodes=pp, gpus_per_node=8, pp=pp, ep=8)


def test_hand_written_layout_with_a_hash_layer_off_stage_0_is_rejected(impl):
    recipe = impl.deepseek_v4_flash_lora_recipe()
    bad = (
        ("embedding", "decoder", "decoder"),
        *recipe.pipeline_layout[1:-1],
        ("decoder",) + recipe.pipeline_layout[-1],
    )
    bad = tuple(tuple(s) for s in bad)
    with pytest.raises(impl.PipelineLayoutError, match=r"stage 0 holds 2 decoders but 3 hash layers"):
        dataclasses.replace(recipe, pipeline_layout=bad)


def test_layout_with_the_wrong_number_of_stages_is_rejected(impl):
    recipe = impl.deepseek_v4_flash_lora_recipe()
    with pytest.raises(impl.UnsupportedConfigError, match=r"3 stages but PP\*VPP=4"):
        dataclasses.replace(recipe, pipeline_layout=impl.generate_pipeline_layout(43, 3, num_hash_layers=3))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"targets": ("wq_a", "experts")}, r"must be a non-empty subset"),
        ({"lora_dropout": 1.0}, r"0 <= dropout < 1"),
        ({"global_batch_size": 12}, r"global_batch_size=12 is not a multiple of micro_batch_size\*DP=1\*8"),
    ],
    ids=["unknown-target", "dropout-1", "global-batch"],
)
def test_bad_lora_and_batch_settings_are_rejected(impl, change, match):
    with pytest.raises(impl.UnsupportedConfigError, match=match):
        dataclasses.replace(impl.deepseek_v4_flash_lora_recipe(), **change)


# ------------------------------------------------------------------------------------------ tiny variant + CLI


def test_tiny_variant_keeps_every_structural_choice(impl):
    flash = impl.deepseek_v4_flash_lora_recipe()
    tiny = impl.tiny_variant(flash)
    kept = ("targets", "lora_rank", "lora_alpha", "lora_dropout", "optimizer", "moe_token_dispatcher_type")
    for name in (*kept, "recompute_granularity", "recompute_method", "recompute_modules", "include_mtp", "tp"):
        assert getattr(tiny, name) == getattr(flash, name), f"tiny variant changed {name}"
    assert (tiny.world_size, tiny.pp, tiny.ep, tiny.preset) == (2, 2, 1, "tiny-tp")
    cfg = get_preset("tiny-tp")
    _assert_layout_properties(
        tiny.pipeline_layout,
        num_layers=cfg.num_hidden_layers,
        num_hash=_hash_prefix(cfg),
        mtp=cfg.num_nextn_predict_layers,
        stages=2,
        who="tiny pp2",
    )
    assert _hash_prefix(cfg) >= 1, "tiny-tp lost its hash layer; the variant would not test hash placement"
    m = tiny.model
    got = (m.num_layers, m.num_hash_layers, m.mtp_layers, m.num_experts, m.num_heads, m.o_groups, m.vocab_size)
    want = (
        cfg.num_hidden_layers,
        _hash_prefix(cfg),
        cfg.num_nextn_predict_layers,
        cfg.n_routed_experts,
        cfg.num_attention_heads,
        cfg.o_groups,
        cfg.vocab_size,
    )
    assert got == want, f"the tiny variant's model facts {got} differ from the tiny-tp preset qualify writes {want}"
    assert tiny.seq_length == min_seq_len(cfg), f"seq_length {tiny.seq_length}, preset's full-coverage length"


def test_tiny_variant_on_an_unknown_preset_is_rejected(impl):
    with pytest.raises(impl.UnsupportedConfigError, match="no tiny model 'tiny-huge'"):
        impl.tiny_variant(preset="tiny-huge")


BOOLEAN_FLAGS = ("--no-oracle",)


def _flags(words: list[str]) -> tuple[dict[str, str], set[str]]:
    """``--flag value`` pairs and the bare boolean flags of a qualify command line (after ``qualify``)."""
    switches = {w for w in words if w in BOOLEAN_FLAGS}
    rest = [w for w in words if w not in BOOLEAN_FLAGS]
    return dict(zip(rest[0::2], rest[1::2], strict=True)), switches


def test_qualify_args_carry_the_recipe_and_need_a_checkpoint(impl, monkeypatch, tmp_path):
    monkeypatch.delenv("DSV4_FLASH_CHECKPOINT", raising=False)
    with pytest.raises(impl.UnsupportedConfigError, match="DSV4_FLASH_CHECKPOINT"):
        impl.to_qualify_args(impl.deepseek_v4_flash_lora_recipe())
    monkeypatch.setenv("DSV4_FLASH_CHECKPOINT", str(tmp_path))
    args = impl.to_qualify_args(impl.deepseek_v4_flash_lora_recipe(), out="o")
    flags, switches = _flags(args[1:])
    assert args[0] == "qualify" and flags["--base"] == str(tmp_path)
    assert switches == {"--no-oracle"}, f"a full-size checkpoint recipe must qualify without the oracle: {args}"
    tiny_flags, tiny_switches = _flags(impl.to_qualify_args(impl.tiny_variant())[1:])
    assert not tiny_switches and tiny_flags["--preset"], "the tiny variant keeps the transformers oracle"
    assert {k: flags[k] for k in ("--tp", "--pp", "--ep", "--nproc", "--rank")} == {
        "--tp": "1",
        "--pp": "4",
        "--ep": "8",
        "--nproc": "32",
        "--rank": "16",
    }
    assert flags["--targets"].split(",") == list(FIVE) and float(flags["--alpha"]) == 32.0


@pytest.mark.slow
@pytest.mark.xdist_group("cli")
def test_tiny_variant_passes_dsv4_lora_qualify_on_two_cpu_ranks(impl, tmp_path):
    args = impl.to_qualify_args(impl.tiny_variant(), out=str(tmp_path / "q"), timeout_s=600)
    t0 = time.perf_counter()
    result = run([sys.executable, "-m", f"{impl.name}.cli", *args], timeout=900)
    wall = time.perf_counter() - t0
    assert result.returncode == 0, f"qualify {args} exited {result.returncode}:\n{result.stdout[-6000:]}"
    report = json.loads((tmp_path / "q" / "qualify.json").read_text())
    print(f"tiny-variant qualify: {wall:.1f}s wall (report wall_s {report['wall_s']})")
    assert [c["name"] for c in report["checks"]] == QUALIFY_CHECKS, [c["name"] for c in report["checks"]]
    failed = [c for c in report["checks"] if c["passed"] is not True]
    assert report["ok"] is True and not failed, f"checks not passed: {failed}"
    opts = report["options"]
    assert (opts["tp"], opts["pp"], opts["ep"], opts["nproc"], opts["rank"]) == (1, 2, 1, 2, 16), opts


@pytest.fixture(scope="module")
def tiny_recipe_run(impl, tmp_path_factory):
    """The 32-GPU run's own rank function (strict load, clipped Adam steps, export) on the tiny twin, PP=2."""
    from fixtures.ranks.recipe_rank_fns import RecipeRunCase, rank_lora_recipe
    from fixtures.runner.multirank import impl_preload, run_ranks
    from tiny_models.oracle import write_checkpoint

    tmp = tmp_path_factory.mktemp("tiny-recipe")
    tiny = impl.tiny_variant()
    recipe = dataclasses.replace(tiny, checkpoint=str(write_checkpoint(tiny.preset, tmp / "base", seed=3)))
    case = RecipeRunCase(impl.name, recipe, str(tmp / "adapter"))
    results = run_ranks(rank_lora_recipe, case, nproc=recipe.world_size, timeout_s=300, preload=impl_preload(impl.name))
    return case, results


@pytest.mark.multirank
def test_gpu32_rank_function_trains_and_exports_the_tiny_variant_on_two_cpu_ranks(tiny_recipe_run):
    case, results = tiny_recipe_run
    for r in results:
        p = r.payload
        totals = p["load_totals"]
        assert totals["unmapped"] == 0 and totals["missing"] == 0, f"rank {r.rank}: load totals {totals}"
        assert len(p["losses"]) == case.steps and all(torch.isfinite(torch.tensor(p["losses"]))), p["losses"]
        assert any(".decoder." in n for n in p["updates"]), f"rank {r.rank}: no decoder adapters trained"
    assert results[0].payload["losses"] == results[1].payload["losses"], "pipeline stages disagree on the loss"
    # The decoder's adapters only: the recipe also wraps its MTP layer, which the train step's loss (the main
    # model's) does not reach; those adapters are not exported either (transformers has no MTP layer).
    bad = [
        f"rank {r.rank} {n}"
        for r in results
        for n, (delta, finite) in r.payload["updates"].items()
        if ".decoder." in n and (not finite or delta == 0.0)
    ]
    assert not bad, f"decoder adapters with no or non-finite update: {bad[:10]}"
    assert (pathlib.Path(case.out) / ".complete").exists(), "the export did not publish"


# ------------------------------------------------------------------------------------------ launch scripts


@pytest.mark.parametrize("script", ["launch_torchrun.sh", "launch_slurm.sbatch"])
def test_launch_script_is_valid_bash(script):
    path = RECIPES / script
    result = run(["bash", "-n", str(path)], timeout=30)
    assert result.returncode == 0, f"bash -n {path}: {result.stderr}"


def test_torchrun_script_passes_the_recipe_qualify_flags(impl, monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_FLASH_CHECKPOINT", str(tmp_path))
    want = impl.to_qualify_args(impl.deepseek_v4_flash_lora_recipe())
    text = (RECIPES / "launch_torchrun.sh").read_text()
    block = re.search(r"-m impl\.cli qualify(.*?)\n\s*;;", text, re.S)
    assert block, "launch_torchrun.sh has no qualify invocation of the command line"
    words = shlex.split(block[1].replace("\\\n", " "))
    got, got_switches = _flags(words)
    wanted, want_switches = _flags(want[1:])
    assert got_switches == want_switches, f"launch_torchrun.sh switches {got_switches} != recipe {want_switches}"
    for flag in ("--tp", "--pp", "--ep", "--targets", "--rank", "--alpha"):
        assert got.get(flag) == wanted[flag], f"launch_torchrun.sh {flag} {got.get(flag)!r} != recipe {wanted[flag]!r}"
    assert got["--base"] == "$DSV4_FLASH_CHECKPOINT", f"launch_torchrun.sh --base {got['--base']!r}"
    assert "--nnodes" in text and "--nproc-per-node" in text and "--rdzv-endpoint" in text


def test_recipe_doc_names_every_launch_script_and_the_checkpoint_variable():
    doc = (RECIPES / "deepseek_v4_flash_lora.md").read_text()
    for needle in ("launch_torchrun.sh", "launch_slurm.sbatch", "DSV4_FLASH_CHECKPOINT", "TP=1", "PP=4", "EP=8"):
        assert needle in doc, f"recipes/deepseek_v4_flash_lora.md does not mention {needle}"


# ------------------------------------------------------------------------------------------ GPU suites on CPU

GPU_IDS = [
    *(
        f"suites/reference/test_gpu.py::{test}[{layout}]"
        for test in (
            "test_load_then_export_is_bit_exact_and_logits_match_oracle_under_nccl",
            "test_trained_lora_logits_equal_merged_oracle_under_nccl",
        )
        for layout in ("ep8", "pp2-ep4", "tp2-ep4", "tp4-pp2")
    ),
    "suites/reference/test_gpu32.py::test_flash_recipe_loads_the_real_checkpoint_strictly_on_every_rank",
    "suites/reference/test_gpu32.py::test_flash_recipe_lora_updates_are_finite_and_nonzero_on_every_rank",
    "suites/reference/test_gpu32.py::test_flash_recipe_adapter_passes_verify_adapter_cli",
]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]


def test_gpu_suites_collect_on_a_cpu_host_and_skip_with_the_cuda_reason():
    """One subprocess (collection is slow, docs/performance.md): every expected id is collected and skipped."""
    result = run([*PYTEST, "-v", "-rs", "-m", "gpu or gpu32", "suites/reference/test_gpu.py", "suites/reference/test_gpu32.py"],
                 timeout=180)  # fmt: skip
    assert result.returncode == 0, f"pytest -m 'gpu or gpu32' failed:\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("suites/reference/test_gpu")]
    collected = {line.split()[0] for line in lines}
    assert collected == set(GPU_IDS), f"missing {set(GPU_IDS) - collected}; unexpected {collected - set(GPU_IDS)}"
    if not torch.cuda.is_available():
        not_skipped = [line for line in lines if " SKIPPED" not in line]
        assert not not_skipped, "expected every GPU test skipped on a CPU host:\n" + "\n".join(not_skipped)
        reasons = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED [")]
        assert reasons and all("needs CUDA" in line for line in reasons), "\n".join(reasons)
        assert f"{len(GPU_IDS)} skipped" in result.stdout, result.stdout[-3000:]

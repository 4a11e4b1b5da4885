"""Train -> gather -> export -> load with real PEFT reproduces the native model's logits.

Per layout (TP=1, TP=2, EP=2, PP=2): the native model is built with [load base, LoRA] pre-wrap hooks and DDP,
trained for a few Adam steps, gathered and exported (transformers dialect, with a base fingerprint). In this
process, ``peft.PeftModel.from_pretrained(<transformers oracle>, adapter_dir)`` must then give the native logits:
merged (``merge_and_unload``) and unmerged through ``impl.load_peft_adapter`` (which registers the grouped LoRA layer
for ``o_a_proj``) for the five-target adapter, and stock PEFT's unmerged forward for the four plain targets."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel

import fixtures.asserts as ah
from fixtures.ranks.e2e_rank_fns import case_ids, oracle_logits, run_e2e, trained_case
from tiny_models.oracle import load_oracle
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-e2e")]

PRESET = "tiny-tp"
BASE_SEED = 5
#: units of eps(float32) * max|PEFT logits|, qualify's float32 reload figure (the analysis: _assert_peft_matches)
LOGIT_ULPS = 256


def _native_logits(results) -> list[tuple[int, torch.Tensor]]:
    return [(r.rank, torch.from_numpy(r.payload["logits"])) for r in results if "logits" in r.payload]


def _assert_peft_matches(layout, results, ckpt, adapter_dir, *, how: str, load=None) -> None:
    """``how`` names the reload in messages; ``load(model, adapter_dir)`` returns the model to compare (default:
    stock ``PeftModel.from_pretrained``, unmerged).

    Tolerance: ``LOGIT_ULPS * eps(float32) * max|PEFT logits|``, the comparison ``qualify``'s ``reload`` check makes
    (same figure): native (sharded, each rank summing in its own order) and transformers + PEFT are two fp32
    forwards of one function, and a merged reload also rounds ``W + s B@A`` once per target weight, so they differ
    by rounding, in units of eps * scale. The smallest effect claimed is one target in one layer: dropping it would
    move the logits by about ``effect / (targets * layers)``, the trained adapter's effect measured here shared
    over its (target, layer) pairs, and that share must exceed the tolerance.
    """
    case_vocab = get_preset(PRESET).vocab_size
    ids = case_ids(results.case, case_vocab)
    base = oracle_logits(load_oracle(ckpt), ids)
    model = (load or (lambda m, d: PeftModel.from_pretrained(m, str(d))))(load_oracle(ckpt), adapter_dir).eval()
    want = oracle_logits(model, ids)
    effect = ah.max_abs(want - base)
    tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=ah.max_abs(want))
    pairs = len(results.case.targets) * get_preset(PRESET).num_hidden_layers
    ah.assert_effect_exceeds(
        effect,
        tolerance,
        factor=pairs,
        what=f"the trained adapter ({how}), shared over {pairs} (target, layer) pairs",
        context=layout,
    )
    native = _native_logits(results.ranks)
    assert native, f"{layout}: no rank returned logits"
    for rank, got in native:
        ah.assert_close_ulps(
            got,
            want,
            dtype=torch.float32,
            ulps=LOGIT_ULPS,
            name=f"native logits vs PEFT ({how}) on the exported adapter",
            context=f"{layout} rank {rank}, adapter effect {effect:.2e}",
        )


class _Run:
    def __init__(self, case, ranks):
        self.case, self.ranks = case, ranks


def _run(impl, tiny_ckpt_factory, layout: str) -> tuple[_Run, str, Path]:
    ckpt = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    case, nproc = trained_case(impl.name, ckpt, layout, seq=min_seq_len(get_preset(PRESET)))
    results = run_e2e(case, nproc=nproc)
    dirs = {r.payload["export_dir"] for r in results}
    assert len(dirs) == 1, f"{layout}: ranks disagree on the export directory: {dirs}"
    return _Run(case, results), ckpt, Path(dirs.pop())


@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2", "pp2"])
def test_trained_five_target_adapter_reloads_in_peft_merged_and_unmerged_with_native_logits(
    impl, tiny_ckpt_factory, layout
):
    run, ckpt, adapter_dir = _run(impl, tiny_ckpt_factory, layout)
    assert (adapter_dir / impl.COMPLETE_MARKER).is_file(), f"{layout}: {adapter_dir} has no completion marker"
    impl.validate_adapter_dir(adapter_dir)
    impl.verify_fingerprint(adapter_dir, ckpt)
    other = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED + 1))
    with pytest.raises(impl.FingerprintMismatchError):
        impl.verify_fingerprint(adapter_dir, other)
    merged = lambda m, d: PeftModel.from_pretrained(m, str(d)).merge_and_unload()  # noqa: E731
    _assert_peft_matches(layout, run, ckpt, adapter_dir, how="merged", load=merged)
    _assert_peft_matches(layout, run, ckpt, adapter_dir, how="unmerged, grouped o_a_proj", load=impl.load_peft_adapter)


def test_trained_plain_four_target_adapter_reloads_in_peft_unmerged_with_native_logits(impl, tiny_ckpt_factory):
    run, ckpt, adapter_dir = _run(impl, tiny_ckpt_factory, "tp2-plain")
    impl.validate_adapter_dir(adapter_dir)
    _assert_peft_matches("tp2-plain", run, ckpt, adapter_dir, how="unmerged")


def _renamed_shards(shards: Path, naming: str, case, out: Path) -> Path:
    """The per-rank shards under another of Miles' namings: ``rank`` (HEAD: ``adapter_megatron_rank{r}.pt``, ranks
    in Megatron's default order, tp fastest), ``stage-local`` (layer numbers local to each pipeline stage, as
    Megatron's ``TransformerBlock`` names them; the native graph here numbers them globally)."""
    import re

    layer = re.compile(r"(decoder\.layers\.)(\d+)(\.)")
    out.mkdir()
    for f in sorted(shards.glob("adapter_megatron_tp*_pp*.pt")):
        t, p = map(int, re.fullmatch(r"adapter_megatron_tp(\d+)_pp(\d+)\.pt", f.name).groups())
        params = torch.load(f, weights_only=True)
        if naming == "stage-local":
            first = min(int(m[2]) for n in params if (m := layer.search(n)))
            params = {layer.sub(lambda m, o=first: f"{m[1]}{int(m[2]) - o}{m[3]}", n, count=1): v
                      for n, v in params.items()}  # fmt: skip
        name = f"adapter_megatron_rank{t + case.tp * p}.pt" if naming == "rank" else f.name
        torch.save(params, out / name)
    return out


def _convert(impl, capfd, *args) -> tuple[int, str]:
    """``dsv4-lora convert-adapter ARGS`` in this process (the command's own entry point): exit status, output."""
    import importlib

    capfd.readouterr()
    status = importlib.import_module(f"{impl.name}.cli.main").main(["convert-adapter", *map(str, args)])
    said = capfd.readouterr()
    return status, said.out + said.err


@pytest.mark.parametrize(
    "layout,naming", [("tp2", "tp-pp"), ("tp2", "rank"), ("pp2", "tp-pp"), ("pp2", "stage-local"), ("pp2", "rank")]
)
def test_native_shards_saved_rank_by_rank_reassemble_into_an_adapter_with_the_native_logits(
    impl, tiny_ckpt_factory, tmp_path, capfd, layout, naming
):
    """Miles' native LoRA checkpoint (each rank's own adapter parameters, ``torch.save``d: written here by the ranks
    exactly as Miles' ``save_lora_checkpoint`` does) reassembled by ``convert-adapter`` must reload in PEFT with the
    logits of the native model that saved it."""
    run, ckpt, _ = _run(impl, tiny_ckpt_factory, layout)
    shards = Path(run.case.native_shards_dir)
    assert len(list(shards.glob("*.pt"))) == run.case.tp * run.case.pp, f"{layout}: {sorted(shards.iterdir())}"
    src = shards if naming == "tp-pp" else _renamed_shards(shards, naming, run.case, tmp_path / naming)
    args = ["--adapter", src, "--out", tmp_path / "out", "--alpha", run.case.alpha, "--base", ckpt]
    status, said = _convert(
        impl, capfd, *args, *(["--tp", run.case.tp, "--pp", run.case.pp] if naming == "rank" else [])
    )
    assert status == 0, f"{layout}/{naming}: {said[-3000:]}"
    merged = lambda m, d: PeftModel.from_pretrained(m, str(d)).merge_and_unload()  # noqa: E731
    _assert_peft_matches(layout, run, ckpt, tmp_path / "out", how=f"merged, from {naming} native shards", load=merged)


def test_native_shards_with_ranks_missing_are_refused_and_nothing_is_written(impl, tiny_ckpt_factory, tmp_path, capfd):
    run, _, _ = _run(impl, tiny_ckpt_factory, "tp2")
    saved, src = Path(run.case.native_shards_dir), tmp_path / "shards"
    src.mkdir()
    (src / "adapter_megatron_tp0_pp0.pt").write_bytes((saved / "adapter_megatron_tp0_pp0.pt").read_bytes())
    (src / "adapter_megatron_tp1_pp1.pt").write_bytes((saved / "adapter_megatron_tp1_pp0.pt").read_bytes())
    status, said = _convert(impl, capfd, "--adapter", src, "--out", tmp_path / "out", "--alpha", run.case.alpha)
    assert status == 1 and "Traceback" not in said, said
    assert "NativeShardError" in said and "(0, 1)" in said, said
    assert not (tmp_path / "out").exists(), "a refused conversion left an output"


def _pickled_peft_adapter(where: Path, value: float) -> Path:
    """A PEFT adapter directory as older PEFT saved it: ``adapter_model.bin`` (a pickle) and its config."""
    import json

    where.mkdir(parents=True)
    torch.save(
        {"base_model.model.layers.0.attn.wq_a.lora_A.weight": torch.full((2, 3), value)}, where / "adapter_model.bin"
    )
    (where / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "peft_type": "LORA"}))
    return where


def test_a_conversion_replaces_an_earlier_one_whole_with_a_marker_certifying_every_file(impl, tmp_path, capfd):
    """``convert-adapter`` publishes by the export's protocol: over an earlier conversion, the destination ends up
    the new adapter alone, its ``.complete`` naming the sha256 of each file, and nothing is left beside it."""
    import hashlib
    import json

    from safetensors.torch import load_file

    out = tmp_path / "published" / "out"  # the sources live elsewhere: snapshots cover the parent
    for value in (1.0, 2.0):
        src = _pickled_peft_adapter(tmp_path / f"src{value:g}", value)
        status, said = _convert(impl, capfd, "--adapter", src, "--out", out)
        assert status == 0, said
    (tensor,) = load_file(out / "adapter_model.safetensors").values()
    assert torch.equal(tensor, torch.full((2, 3), 2.0)), "the destination does not hold the last conversion"
    marker = json.loads((out / impl.COMPLETE_MARKER).read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != impl.COMPLETE_MARKER)
    assert files == ["adapter_config.json", "adapter_model.safetensors"], files
    certified = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in files}
    assert marker["files"] == certified, f".complete certifies {marker['files']}, the files hash to {certified}"
    # what the marker says besides: an adapter, in version 1 of the format, its naming dialect not recorded
    assert marker == {"format": "dsv4-lora-adapter", "version": 1, "dialect": "unrecorded", "files": certified}, marker
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "the conversion left files beside it"


@pytest.mark.parametrize("failing", ["publishing", "marking"])
def test_a_conversion_failing_before_its_commit_leaves_the_earlier_adapter_exactly(
    impl, tmp_path, capfd, monkeypatch, failing
):
    """A conversion that fails while it puts the new adapter in place (its rename into the destination, or its
    ``.complete``) restores the earlier adapter byte for byte and leaves nothing beside it."""
    import os

    from fixtures.data.adapter_states import snapshot_tree

    out = tmp_path / "published" / "out"  # the sources live elsewhere: snapshots cover the parent
    status, said = _convert(impl, capfd, "--adapter", _pickled_peft_adapter(tmp_path / "src1", 1.0), "--out", out)
    assert status == 0, said
    before = snapshot_tree(out)
    real_replace, failed = os.replace, []

    def replace_failing_once(src, dst, *args, **kwargs):
        hit = Path(dst) == out if failing == "publishing" else Path(dst).name == impl.COMPLETE_MARKER
        if hit and not failed:
            failed.append(dst)
            raise OSError(f"disk full (injected, {failing})")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace_failing_once)
    status, said = _convert(impl, capfd, "--adapter", _pickled_peft_adapter(tmp_path / "src2", 2.0), "--out", out)
    monkeypatch.undo()
    assert failed, f"the conversion never reached its {failing} step: the test proves nothing"
    assert status != 0 and "disk full" in said, f"the failed conversion reported success: {said}"
    assert snapshot_tree(out) == before, "a conversion failing before its commit changed the earlier adapter"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "the failed conversion left files beside it"


def test_a_conversion_whose_cleanup_fails_after_its_commit_still_succeeds(impl, tmp_path, capfd, monkeypatch):
    """Deleting the replaced adapter comes after the commit point: when it fails the conversion has still published
    the new adapter and says so (exit 0), and the next conversion deletes the leftover."""
    import os

    from safetensors.torch import load_file

    out = tmp_path / "published" / "out"
    status, said = _convert(impl, capfd, "--adapter", _pickled_peft_adapter(tmp_path / "src1", 1.0), "--out", out)
    assert status == 0, said
    real_rmdir, refused = os.rmdir, []

    def rmdir_refusing_the_replaced_adapter(path, *args, **kwargs):
        if os.fsdecode(path).endswith(".dsv4-trash"):
            refused.append(path)
            raise OSError("device busy (injected)")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_refusing_the_replaced_adapter)
    status, said = _convert(impl, capfd, "--adapter", _pickled_peft_adapter(tmp_path / "src2", 2.0), "--out", out)
    monkeypatch.undo()
    assert refused, "the conversion never deleted the adapter it replaced: the test proves nothing"
    assert status == 0, f"a cleanup failure after the commit failed the conversion: {said}"
    (tensor,) = load_file(out / "adapter_model.safetensors").values()
    assert torch.equal(tensor, torch.full((2, 3), 2.0)), "the committed conversion is not in place"
    assert (out / impl.COMPLETE_MARKER).is_file(), "the committed conversion has no .complete"
    status, said = _convert(impl, capfd, "--adapter", _pickled_peft_adapter(tmp_path / "src3", 3.0), "--out", out)
    assert status == 0, said
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "the next conversion did not clean up"

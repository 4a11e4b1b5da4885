"""A base written by another tool: transformers' ``save_pretrained`` of ``DeepseekV4ForCausalLM``.

Every merged or re-saved V4 model is written this way: transformers' module names
(``model.layers.N.self_attn.q_a_proj.weight``, ``model.layers.N.attn_hc.fn``), ``head.weight`` and per-expert
``model.layers.N.mlp.experts.E.w1.weight`` as the checkpoint had them, and no MTP. The base here is made at test time
by transformers itself (the default tiny base loaded, then ``save_pretrained``); the official base it came from is
the oracle for names and shapes. ``coverage``, ``verify-adapter`` and ``qualify`` must read it through the one
mapping table (its names as a layout of their own, the absent MTP stated), and a name of no V4 tensor is named.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fixtures.runner.subproc import run
from tiny_models.oracle import load_oracle, write_checkpoint

pytestmark = [pytest.mark.cpu, pytest.mark.slow]

peft = pytest.importorskip("peft")

MAIN_ATTENTION = r"model\.layers\.\d+\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)"
#: the namings transformers' save_pretrained writes, each told by a name only it has: (that name, the layout the
#: commands must name, a tensor of no V4 module in that naming)
WRITERS = {
    "module names (transformers 5.12-5.23)": (
        "model.layers.0.self_attn.q_a_proj.weight",
        "transformers",
        "model.layers.0.self_attn.mystery_proj.weight",
    ),
    "the checkpoint's names under model. (transformers 5.23, 5.24)": (
        "model.layers.0.attn.wq_a.weight",
        "transformers-checkpoint",
        "model.layers.0.attn.mystery_proj.weight",
    ),
}


def _shapes(folder: Path) -> dict[str, list[int]]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> tuple[Path, Path]:
    """(the official tiny base, the same model as transformers' save_pretrained writes it)."""
    root = tmp_path_factory.mktemp("base-layouts")
    official = write_checkpoint("tiny-mixed", root / "official")
    load_oracle(official).save_pretrained(str(root / "saved"))
    return official, root / "saved"


@pytest.fixture(scope="module")
def writer(bases) -> tuple[str, str, str]:
    """The WRITERS row of the naming this transformers wrote."""
    names = set(_shapes(bases[1]))
    found = [row for row in WRITERS.values() if row[0] in names]
    assert len(found) == 1, f"transformers wrote a naming this suite does not know: {sorted(names)[:12]}"
    return found[0]


@pytest.fixture(scope="module")
def dsv4(impl):
    def run_cli(*args, timeout: float = 300):
        result = run([sys.executable, "-m", f"{impl.name}.cli", *map(str, args)], timeout=timeout)
        assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
        return result

    return run_cli


def test_the_saved_base_is_in_a_naming_of_its_own(bases, writer):
    """The premise, from transformers' own files: none of the official names, and no MTP."""
    official, saved = bases
    names = set(_shapes(saved))
    assert "model.embed_tokens.weight" in names and writer[0] in names
    assert not names & set(_shapes(official)) - {"head.weight"}, sorted(names & set(_shapes(official)))
    assert not any(".mtp" in n or n.startswith("mtp.") for n in names)


def test_a_saved_base_reads_as_the_official_tensors_less_mtp_with_the_same_shapes(impl, bases, writer):
    official, saved = bases
    read = impl.inspect_base(saved)
    assert read.ok, [p.message for p in read.problems]
    assert str(read.layout) == writer[1], read.layout
    want = {n: s for n, s in _shapes(official).items() if not n.startswith("mtp.")}
    got = {n: list(h.shape) for n, h in read.headers.items()}
    assert sorted(set(want) ^ set(got)) == [], f"official names read differently: {sorted(set(want) ^ set(got))[:10]}"
    wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
    assert not wrong, f"shapes differ from the official base's: {wrong}"
    on_disk = set(_shapes(saved))
    assert all(h.stored in on_disk for h in read.headers.values()), "a header names a tensor the file lacks"


def test_coverage_maps_every_tensor_of_a_saved_base_and_states_mtp_absent(dsv4, bases):
    result = dsv4("coverage", "--base", bases[1])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "totals: mapped 162, declared_not_loaded 0, unmapped 0, missing 0" in result.stdout, result.stdout[-2000:]
    assert "MTP absent: 41 tensor(s)" in result.stdout and "save_pretrained naming" in result.stdout


def test_verify_adapter_judges_a_stock_peft_adapter_on_a_saved_base(dsv4, bases, writer, tmp_path):
    model = peft.get_peft_model(
        load_oracle(bases[1]), peft.LoraConfig(r=4, lora_alpha=8, target_modules=MAIN_ATTENTION)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    model.save_pretrained(str(tmp_path / "adapter"))
    result = dsv4("verify-adapter", "--base", bases[1], "--adapter", tmp_path / "adapter")
    assert result.returncode == 0 and "problem:" not in result.stdout, result.stdout[-3000:]
    assert f"{writer[1]} layout (written by save_pretrained; no MTP)" in result.stdout, result.stdout[-3000:]
    assert "UNCERTIFIED" in result.stdout, result.stdout[-3000:]


def test_qualify_trains_exports_and_reloads_on_a_saved_base(dsv4, bases, writer, tmp_path):
    result = dsv4("qualify", "--base", bases[1], "--out", tmp_path / "q", timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"base: {writer[1]} layout (save_pretrained), no MTP" in result.stdout, result.stdout[-3000:]
    assert "load         PASS    162 tensors placed" in result.stdout, result.stdout[-3000:]


def test_a_tensor_of_no_v4_module_in_a_saved_base_is_named(dsv4, bases, writer, tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    for file in bases[1].iterdir():
        (saved / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(saved / "model.safetensors"))
    tensors[writer[2]] = torch.zeros(2, 2)
    save_file(tensors, str(saved / "model.safetensors"), metadata={"format": "pt"})
    result = dsv4("coverage", "--base", saved)
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"1 tensor(s) stand for nothing of a DeepSeek-V4 base: {writer[2]}" in result.stdout, result.stdout[-3000:]

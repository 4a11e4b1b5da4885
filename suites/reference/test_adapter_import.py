"""A published adapter imports back into the native graph at any layout: the reverse of the export.

The adapter an uninterrupted TP=2 run trained (``fixtures.ranks.loop_rank_fns``) is exported here in every dialect
(transformers, official, sglang; with its base fingerprint) and imported (``impl.import_adapter``) into a fresh
model at TP=1, TP=2 and PP=2. Gathered again, every imported adapter equals the trained one bit for bit (native ->
PEFT -> native is exact, whatever the layout), and the imported model's logits equal the trained model's: bit for
bit at the layout it was trained at, within the fp32 rounding of two layouts elsewhere. An adapter that does not
fit (another scale, a NaN) is refused on every rank, naming it, and no parameter changes.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.loop_rank_fns import BASE_SEED, PRESET, loop_case, loop_root, run_loop, uninterrupted_run
from tiny_models.presets import get_preset

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("training-loop")]

DIALECTS = ("transformers", "official", "sglang")
#: units of eps(float32) * max|logits| between two layouts' fp32 forwards (suites/reference/test_training_resume.py)
ULPS = 256


@pytest.fixture(scope="module")
def trained(impl, tiny_ckpt_factory, tmp_path_factory):
    """(base, the trained run's payloads, {dialect: exported directory})."""
    base = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    root = loop_root(tmp_path_factory)
    payloads = uninterrupted_run(impl.name, base, root, "tp2")
    tensors = {n: torch.from_numpy(a) for n, a in payloads[0]["adapter"].items()}
    dirs = {}
    for dialect in DIALECTS:
        dirs[dialect] = root / f"published-{dialect}"
        if not dirs[dialect].exists():
            state = impl.AdapterState(tensors, r=4, alpha=8.0)
            impl.export_adapter(state, dirs[dialect], dialect=dialect, fingerprint_base=base)
    return base, payloads, dirs


def _final_logits(payloads) -> torch.Tensor:
    return torch.from_numpy(next(p["final_logits"] for p in reversed(payloads) if p.get("final_logits") is not None))


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_every_dialect_imports_at_any_layout_bit_exact_with_the_trained_logits(impl, trained, layout):
    base, payloads, dirs = trained
    got = run_loop(impl.name, loop_case(impl.name, base, layout, imports=tuple(str(d) for d in dirs.values())), layout)
    want_logits, want_adapter = _final_logits(payloads), payloads[0]["adapter"]
    tolerance = ah.ulp_tolerance(torch.float32, ulps=ULPS, scale=ah.max_abs(want_logits))
    fresh = torch.from_numpy(next(p["start_logits"] for p in reversed(payloads) if p.get("start_logits") is not None))
    pairs = 5 * get_preset(PRESET).num_hidden_layers
    ah.assert_effect_exceeds(ah.max_abs(want_logits - fresh), tolerance, factor=pairs,
                             what=f"the trained adapter, shared over {pairs} (target, layer) pairs")  # fmt: skip
    for dialect, where in dirs.items():
        imported = got[0]["imports"][str(where)]
        ah.assert_state_dicts_bitwise_equal(
            {n: torch.from_numpy(a) for n, a in imported["adapter"].items()},
            {n: torch.from_numpy(a) for n, a in want_adapter.items()},
            context=f"{dialect} adapter imported at {layout}, gathered again",
        )
        logits = torch.from_numpy(next(p["imports"][str(where)]["logits"] for p in reversed(got)
                                       if p["imports"][str(where)]["logits"] is not None))  # fmt: skip
        if layout == "tp2":
            ah.assert_bitwise_equal(logits, want_logits, name=f"logits after importing the {dialect} adapter")
        else:
            ah.assert_close_ulps(logits, want_logits, dtype=torch.float32, ulps=ULPS,
                                 name=f"logits after importing the {dialect} adapter", context=layout)  # fmt: skip


def _spoiled(dirs, root, label: str, spoil) -> str:
    out = root / f"spoiled-adapter-{label}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(dirs["transformers"], out)
    spoil(out)
    return str(out)


def _other_alpha(d) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    config["lora_alpha"] = 16.0
    (d / "adapter_config.json").write_text(json.dumps(config))
    (d / ".complete").unlink()  # a third party's edit: no marker to contradict it


def _nan(d) -> None:
    from safetensors.torch import load_file, save_file

    file = d / "adapter_model.safetensors"
    tensors = load_file(str(file))
    tensors[sorted(tensors)[0]][0, 0] = float("nan")
    save_file(tensors, str(file), metadata={"format": "pt"})
    (d / ".complete").unlink()


def test_an_adapter_that_does_not_fit_is_refused_on_every_rank_and_changes_nothing(impl, trained, tmp_path_factory):
    base, _, dirs = trained
    root = loop_root(tmp_path_factory)
    spoiled = {"other-scale": (_spoiled(dirs, root, "scale", _other_alpha), "scales B@A by 4"),
               "nan": (_spoiled(dirs, root, "nan", _nan), "NaN")}  # fmt: skip
    case = loop_case(impl.name, base, "tp2", refuse_imports=tuple(d for d, _ in spoiled.values()))
    got = run_loop(impl.name, case, "tp2")
    for rank, payload in enumerate(got):
        assert payload["changed"] == [], f"rank {rank}: a refused import changed {payload['changed']}"
        for label, (where, says) in spoiled.items():
            message = payload["refused"][where]
            assert message is not None, f"rank {rank}: the {label} adapter was imported"
            assert message.startswith("AdapterImportError: ") and where in message, f"{label}: {message}"
            assert says in message, f"{label}: the error does not say {says!r}: {message}"

"""A LoRA target reaches its projection in every layer's main attention, and never the DSA indexer's or a
compressor's module of the same leaf name (a bare ``wq_b`` that wraps ``indexer.wq_b`` trains the wrong weights).

The expected modules are written out here in the checkpoint's names, from the config alone.
"""

from __future__ import annotations

import json

import pytest

from dsv4_conformance.driver import MAIN_ATTENTION
from fixtures.conformance.programs import QualifyCase, qualify_all

pytestmark = [
    pytest.mark.cpu,
    pytest.mark.multirank,
    pytest.mark.needs("qualify"),
    pytest.mark.xdist_group("conformance-targets"),
]

#: the nested modules that share a main target's leaf name
NESTED = (".indexer.", ".compressor.")
PRESETS = ("tiny-tp", "tiny-mixed", "tiny-sliding", "tiny-largest")


def configs() -> dict[str, dict]:
    """Each config as a base's ``config.json`` holds it: Flash in DeepSeek's published form (the schedule as
    ``compress_ratios`` and ``num_hash_layers``, as users download it), the tiny presets as transformers'
    ``save_pretrained`` writes them (their small compression rates have no published form)."""
    from fixtures.data.sparse_checkpoint import published_config
    from tiny_models import flash_config, get_preset

    found = {name: json.loads(get_preset(name).to_json_string()) for name in PRESETS}
    found["flash"] = published_config(flash_config())
    return found


def meant(targets: tuple[str, ...], config: dict) -> set[str]:
    return {f"layers.{i}.attn.{t}" for i in range(config["num_hidden_layers"]) for t in targets}


def allowed_extra(module: str, targets: tuple[str, ...]) -> bool:
    """The multi-token-prediction block's own main attention may be wrapped too (a policy, not a defect)."""
    parts = module.split(".")
    return parts[0] == "mtp" and parts[-2:-1] == ["attn"] and parts[-1] in targets


@pytest.fixture(scope="module")
def qualified(drive, driver_name) -> dict[tuple[str, tuple[str, ...]], tuple[list[str] | None, str]]:
    """Every config x (each target alone, all five, an unknown name, a name and an unknown one), on one rank."""
    found = configs()
    keys = [(name, targets) for name in PRESETS for targets in [*SINGLE, MAIN_ATTENTION, *UNKNOWN]]
    keys += [(name, MAIN_ATTENTION) for name in FULL_SIZE]
    cases = tuple((targets, found[name]) for name, targets in keys)
    (results,) = drive(qualify_all, QualifyCase(driver_name, cases), nproc=1, timeout_s=300)
    return dict(zip(keys, results, strict=True))


SINGLE = [(t,) for t in MAIN_ATTENTION]
UNKNOWN = [("wq_z",), ("wq_b", "wkv_typo")]
#: the published Flash config, with every target at once (a full-size graph is large even where it takes no memory;
#: Pro's differs from Flash's in sizes and layer count, not in the module tree a target is matched in)
FULL_SIZE = ("flash",)
CASES = [(c, t) for c in PRESETS for t in [*SINGLE, MAIN_ATTENTION]] + [(c, MAIN_ATTENTION) for c in FULL_SIZE]


@pytest.mark.parametrize(("config", "targets"), CASES, ids=[f"{c}-{'+'.join(t)}" for c, t in CASES])
def test_each_target_reaches_exactly_its_main_attention_projection(qualified, config, targets):
    modules, error = qualified[(config, targets)]
    assert modules is not None, f"{config}: qualify({list(targets)}) raised {error}"
    nested = sorted(m for m in modules if any(n in f".{m}." for n in NESTED))
    assert not nested, f"{config}: {list(targets)} reached nested modules {nested[:4]} (the indexer or a compressor)"
    want = meant(targets, configs()[config])
    missing = sorted(want - set(modules))
    extra = sorted(m for m in set(modules) - want if not allowed_extra(m, targets))
    assert not missing and not extra, f"{config}: {list(targets)} missed {missing[:4]}, also wrapped {extra[:4]}"


@pytest.mark.parametrize(("targets", "named"), [(("wq_z",), "wq_z"), (("wq_b", "wkv_typo"), "wkv_typo")])
def test_a_target_it_cannot_place_is_refused_naming_it(qualified, targets, named):
    for config in PRESETS:
        modules, error = qualified[(config, targets)]
        assert modules is None, f"{config}: qualify({list(targets)}) returned {modules[:4]} instead of refusing"
        assert named in error, f"{config}: the refusal does not name {named!r}: {error}"

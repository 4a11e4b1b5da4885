"""Exactly DeepSeek-V4 is recognised: ``architectures[0] == "DeepseekV4ForCausalLM"``, nothing else.

Treating V3 as V4 (or V4 as V3) loads a graph with thousands of unmapped tensors; V4.1 keeps the attention names and
changes their shapes, so a V4 adapter does not transfer. The configs are written out here, as ``config.json`` files
parse.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.needs("recognises")]

V4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
NOT_V4 = {
    "no architectures": {"model_type": "deepseek_v4"},
    "architectures null": {"architectures": None, "model_type": "deepseek_v4"},
    "architectures empty": {"architectures": [], "model_type": "deepseek_v4"},
    "DeepSeek-V3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
    "DeepSeek-V3.2": {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"},
    "DeepSeek-V4.1": {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41"},
    "DeepSeek-V4.1 multimodal": {
        "architectures": ["DeepseekV41ForConditionalGeneration"],
        "model_type": "deepseek_v41",
    },
    "lower case": {"architectures": ["deepseekv4forcausallm"]},
    "suffixed": {"architectures": ["DeepseekV4ForCausalLMX"]},
    "prefixed": {"architectures": ["MyDeepseekV4ForCausalLM"]},
    "V4 not first": {"architectures": ["DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM"]},
    "a bare string": {"architectures": "DeepseekV4ForCausalLM"},
    "null entry": {"architectures": [None]},
}


def test_a_v4_config_is_recognised(driver):
    assert driver.recognises(V4) is True
    assert driver.recognises({**V4, "architectures": ["DeepseekV4ForCausalLM", "SomethingElse"]}) is True


def test_the_published_flash_and_pro_configs_are_recognised(driver):
    """As DeepSeek's repositories hold them: the schedule as ``compress_ratios`` and ``num_hash_layers``."""
    from fixtures.data.sparse_checkpoint import published_config
    from tiny_models import flash_config, pro_config

    for name, config in (("Flash", flash_config()), ("Pro", pro_config())):
        assert driver.recognises(published_config(config)) is True, (
            f"the published {name} config.json was not recognised"
        )


def test_configs_transformers_saved_are_recognised(driver, conformance_base):
    """As ``save_pretrained`` re-writes them (a base converted or re-saved with transformers: ``layer_types``,
    ``mlp_layer_types``), the suites' own tiny base among them."""
    from tiny_models import flash_config

    assert driver.recognises(json.loads((conformance_base / "config.json").read_text())) is True, "the tiny base"
    assert driver.recognises(json.loads(flash_config().to_json_string())) is True, "Flash, as transformers saves it"


@pytest.mark.parametrize("case", sorted(NOT_V4))
def test_nothing_else_is_recognised(driver, case):
    assert driver.recognises(NOT_V4[case]) is False, f"{case}: {NOT_V4[case]} was taken for DeepSeek-V4"

"""A mixed-adapter batch (PEFT's ``adapter_names=``: one adapter per row) cannot run on the grouped ``o_a_proj``:
impl.load_peft_adapter's grouped layer refuses it with a typed error that says what to do, instead of failing inside
the base layer or running the rows with the wrong adapter."""

from __future__ import annotations

import copy

import pytest
import torch

from fixtures.data.adapter_states import config_attention_shapes, make_native_adapter

pytestmark = pytest.mark.cpu

R, ALPHA = 4, 8.0
BASE_ROW = "__base__"  # PEFT's name for "no adapter on this row" in a mixed batch


@pytest.fixture(scope="module")
def grouped_adapter_model(impl, tmp_path_factory):
    """(transformers DeepseekV4ForCausalLM with an o_a_proj-only adapter loaded unmerged, token ids of one row)."""
    from transformers import DeepseekV4ForCausalLM

    from tiny_models.presets import get_preset, min_seq_len

    cfg = get_preset("tiny-mixed")
    assert cfg.o_groups > 1, "the preset must have several output groups for o_a_proj to be grouped"
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).eval().float()
    shapes = config_attention_shapes(cfg)
    native = make_native_adapter({"wo_a": shapes["wo_a"]}, cfg.num_hidden_layers, R, seed=3, b_scale=0.5)
    out = tmp_path_factory.mktemp("grouped") / "adapter"
    impl.export_adapter(impl.AdapterState(native, r=R, alpha=ALPHA), out)
    peft_model = impl.load_peft_adapter(copy.deepcopy(model), out).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, min_seq_len(cfg)), generator=torch.Generator().manual_seed(1))
    return peft_model, ids


def test_a_mixed_adapter_batch_on_the_grouped_o_a_proj_is_a_typed_error_saying_merge(impl, grouped_adapter_model):
    peft_model, ids = grouped_adapter_model
    grouped = [n for n, m in peft_model.named_modules() if isinstance(m, impl.GroupedLoraLinear)]
    assert grouped, "load_peft_adapter wrapped no o_a_proj in GroupedLoraLinear: the guard is never reached"
    with torch.no_grad():
        peft_model(ids)  # an ordinary batch runs: the refusal below is about adapter_names alone
        with pytest.raises(impl.GroupedLoRAError) as err:
            peft_model(ids.repeat(2, 1), adapter_names=["default", BASE_ROW])
    msg = str(err.value)
    assert "mixed-adapter" in msg and "o_a_proj" in msg and "merge" in msg, f"the error does not say why/what: {msg}"

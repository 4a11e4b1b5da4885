"""At step 0 the native model's LoRA gradients are the gradients of the same adapter on transformers'
DeepseekV4ForCausalLM + HF PEFT (issue 16, point 4): finite updates alone do not show the gradients point downhill.

Both sides get the same seeded adapter (B non-zero, so A's gradient is not trivially zero), the same batch and the
same loss (mean token cross-entropy against the same labels), in fp32. The native gradient is what the
implementation's train step hands its optimizer (DDP-synchronised ``.grad``); the oracle's comes from plain
autograd through transformers and PEFT (``fixtures/gradient_oracle.py``). At TP=2 every rank's shard is compared
with its slice of the oracle's full gradient. Every wrapped module of every layer, A and B, for all five targets
including the grouped ``wo_a``."""

import pytest
import torch

from fixtures.e2e_rank_fns import FIVE_TARGETS
from fixtures.gradient_oracle import GradCase, oracle_gradients, rank_step0_gradients
from fixtures.multirank import impl_preload, run_ranks
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-gradients")]

PRESET = "tiny-tp"
BASE_SEED = 5
GRAD_RTOL = 1e-5  # max |native - oracle| / max |oracle| per tensor (and per shard)
LOSS_RTOL = 1e-6
MIN_GRAD = 1e-6  # every oracle gradient must be far from zero, or the comparison proves nothing


@pytest.fixture(scope="module")
def oracle(tiny_ckpt_factory):
    ckpt = str(tiny_ckpt_factory(PRESET, seed=BASE_SEED))
    case = GradCase("", ckpt, tp=1, seq=min_seq_len(get_preset(PRESET)))
    loss, grads = oracle_gradients(case)
    return ckpt, loss, grads


def test_the_oracle_gradients_cover_every_target_and_are_not_trivial(oracle):
    _, _, grads = oracle
    layers = get_preset(PRESET).num_hidden_layers
    want = {(i, t, h) for i in range(layers) for t in FIVE_TARGETS for h in "AB"}
    assert set(grads) == want, f"oracle adapter halves: missing {sorted(want - set(grads))}"
    small = {k: float(g.abs().max()) for k, g in grads.items() if g.abs().max() <= MIN_GRAD}
    assert not small, f"oracle gradients too small to compare: {small}"


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_step0_lora_gradients_equal_transformers_peft(impl, oracle, tp):
    ckpt, want_loss, want = oracle
    case = GradCase(impl.name, ckpt, tp=tp, seq=min_seq_len(get_preset(PRESET)))
    results = run_ranks(rank_step0_gradients, case, nproc=tp, timeout_s=150, preload=impl_preload(impl.name))
    problems = []
    for res in results:
        p = res.payload
        where = f"TP={tp} rank {res.rank}"
        if abs(p["loss"] - want_loss) > LOSS_RTOL * abs(want_loss):
            problems.append(f"{where}: loss {p['loss']:.8f}, oracle {want_loss:.8f}")
        seen = set()
        for name, (grad, dim) in p["grads"].items():
            layer, leaf, half = _key(name)
            seen.add((layer, leaf, half))
            label = f"{where} {leaf} layer {layer} lora_{half}"
            full = want[(layer, leaf, half)]
            expected = full if dim is None else full.chunk(tp, dim=dim)[p["tp_rank"]]
            if grad is None:
                problems.append(f"{label}: no gradient")
                continue
            got = torch.from_numpy(grad)
            if got.shape != expected.shape:
                problems.append(f"{label}: gradient shape {tuple(got.shape)}, oracle slice {tuple(expected.shape)}")
                continue
            rel = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
            if not rel <= GRAD_RTOL:
                problems.append(f"{label}: relative error {rel:.2e} (max|oracle| {float(expected.abs().max()):.2e})")
        missing = sorted(set(want) - seen)
        if missing:
            problems.append(f"{where}: no native gradient for {missing}")
    assert not problems, f"{len(problems)} LoRA gradients differ from transformers + PEFT:\n" + "\n".join(problems)


def _key(native_name: str) -> tuple[int, str, str]:
    from fixtures.gradient_oracle import HALF_OF, NATIVE_HALF

    m = NATIVE_HALF.fullmatch(native_name)
    assert m is not None, native_name
    return int(m[1]), m[2], HALF_OF[m[3]]

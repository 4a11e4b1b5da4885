"""At step 0 the native model's LoRA gradients are the gradients of the same adapter on transformers'
DeepseekV4ForCausalLM + HF PEFT: finite updates alone do not show the gradients point downhill.

Both sides get the same seeded adapter (B non-zero, so A's gradient is not trivially zero), the same batch and the
same loss (mean token cross-entropy against the same labels), in fp32. The native gradient is what the
implementation's train step hands its optimizer (DDP-synchronised ``.grad``); the oracle's comes from plain
autograd through transformers and PEFT (``fixtures/ranks/gradient_oracle.py``). At TP=2 every rank's shard is compared
with its slice of the oracle's full gradient. Every wrapped module of every layer, A and B, for all five targets
including the grouped ``wo_a``."""

import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.e2e_rank_fns import FIVE_TARGETS
from fixtures.ranks.gradient_oracle import GradCase, oracle_gradients, rank_step0_gradients
from fixtures.runner.multirank import impl_preload, run_ranks
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank, pytest.mark.xdist_group("lora-gradients")]

PRESET = "tiny-tp"
BASE_SEED = 5
#: units of eps(float32) * max|oracle gradient| per tensor (and per shard, at the shard's own size): two fp32
#: backwards through the whole model, each rounding as its forward does (test_native_oracle_property's analysis,
#: up to ~32 units per side, and a small gradient's own size is below the flows it sums), so 128 as for the logits
GRAD_ULPS = 128
#: units of eps(float32) * |oracle loss|: the mean of per-token cross entropies, each moved by at most
#: 2 max|Δ logit| (softmax - onehot has L1 norm <= 2) with logits of the loss's size differing by a few units,
#: and the mean averages the tokens' independent roundings; 8 leaves room
LOSS_ULPS = 8
#: every oracle gradient must exceed this many gradient tolerances at the largest gradient's scale: a backward
#: rounds relative to the flows it sums, so a gradient below that would be compared against rounding noise
EFFECT_FACTOR = 10


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
    flows = max(ah.max_abs(g) for g in grads.values())
    floor = ah.ulp_tolerance(torch.float32, ulps=GRAD_ULPS, scale=flows)
    least = min(grads, key=lambda k: ah.max_abs(grads[k]))
    ah.assert_effect_exceeds(
        ah.max_abs(grads[least]), floor, factor=EFFECT_FACTOR, what=f"oracle gradient {least} (too small to compare?)"
    )


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_step0_lora_gradients_equal_transformers_peft(impl, oracle, tp):
    ckpt, want_loss, want = oracle
    case = GradCase(impl.name, ckpt, tp=tp, seq=min_seq_len(get_preset(PRESET)))
    results = run_ranks(rank_step0_gradients, case, nproc=tp, timeout_s=150, preload=impl_preload(impl.name))
    problems = []
    for res in results:
        p = res.payload
        where = f"TP={tp} rank {res.rank}"
        loss_tol = ah.ulp_tolerance(torch.float32, ulps=LOSS_ULPS, scale=abs(want_loss))
        if not abs(p["loss"] - want_loss) <= loss_tol:
            problems.append(f"{where}: loss {p['loss']:.8f}, oracle {want_loss:.8f} (tolerance {loss_tol:.2e})")
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
            diff, scale = ah.max_abs(got - expected), ah.max_abs(expected)
            if not diff <= ah.ulp_tolerance(torch.float32, ulps=GRAD_ULPS, scale=scale):
                problems.append(
                    f"{label}: max|Δ| {diff:.2e} is above {GRAD_ULPS} units of eps(float32) * max|oracle| ({scale:.2e})"
                )
        missing = sorted(set(want) - seen)
        if missing:
            problems.append(f"{where}: no native gradient for {missing}")
    assert not problems, f"{len(problems)} LoRA gradients differ from transformers + PEFT:\n" + "\n".join(problems)


def _key(native_name: str) -> tuple[int, str, str]:
    from fixtures.ranks.gradient_oracle import HALF_OF, NATIVE_HALF

    m = NATIVE_HALF.fullmatch(native_name)
    assert m is not None, native_name
    return int(m[1]), m[2], HALF_OF[m[3]]

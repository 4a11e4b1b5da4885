"""LoRA trains the adapter alone, with the gradient of the implementation's own forward, at every layout.

Two exports one plain SGD step apart give the step the implementation took: ``(A1 - A2) / lr`` must be the gradient
of the loss with respect to A at ``(A1, B1)``, and the same for B, as the judge computes it on transformers' model
of the base with ``W + s·B@A`` (every target, the grouped ``wo_a`` included). Per tensor, the tolerance is the
float32 rule over the gradient and the step's own rounding, and must be below that tensor's gradient (a tensor
whose gradient went missing is caught). On one fixed batch the loss falls.
"""

from __future__ import annotations

import pytest

from dsv4_conformance.judge.artifacts import judge_adapter_dir
from dsv4_conformance.judge.oracle import GRADIENT_RULE, base_model, oracle_gradients, read_adapter
from fixtures.conformance.plugin import TRAIN_LAYOUTS, TRAINED_MARKS
from fixtures.conformance.programs import LR, fixed_batch

pytestmark = [pytest.mark.cpu, *TRAINED_MARKS]


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS)
def test_the_loss_falls_on_a_fixed_batch(trained, layout):
    losses = trained(layout)["losses"]
    assert all(loss == loss for loss in losses), f"{layout}: a loss is NaN: {losses}"
    assert losses[-1] < losses[0], f"{layout}: the loss did not fall over {len(losses)} steps: {losses}"


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS)
def test_a_step_is_the_oracle_gradient_of_every_adapter_tensor(trained, layout, conformance_base):
    import torch

    run = trained(layout)
    for export in ("step1", "step2"):
        unreadable = [
            p for p in judge_adapter_dir(run["out"] / export, conformance_base) if p.check in ("files", "format")
        ]
        assert not unreadable, (
            f"{layout}: the step is read from the exports, and {export} is not readable: {unreadable[0]}"
        )
    step1, scale = read_adapter(run["out"] / "step1")
    step2, _ = read_adapter(run["out"] / "step2")
    assert set(step1) == set(step2) and step1, f"{layout}: the two exports hold different modules"
    ids, labels = fixed_batch(str(conformance_base), run["case"].seed)
    loss, grads = oracle_gradients(base_model(conformance_base), ids, labels, step1, scale)
    eps = torch.finfo(torch.float32).eps
    assert abs(run["losses"][1] - loss) <= GRADIENT_RULE.units * eps * abs(loss), (
        f"{layout}: the loss at step 2 is {run['losses'][1]:.6f}, the oracle's {loss:.6f}"
    )
    wrong, powerless = [], []
    for module, (a1, b1) in sorted(step1.items()):
        a2, b2 = step2[module]
        for half, before, after, want in (("A", a1, a2, grads[module][0]), ("B", b1, b2, grads[module][1])):
            got = (before - after) / LR
            scale_g = float(want.abs().max())
            tolerance = GRADIENT_RULE.units * eps * (scale_g + float(before.abs().max()) / LR)
            diff = float((got - want).abs().max())
            if diff > tolerance:
                wrong.append(f"{module}.lora_{half}: max|step/lr - gradient| = {diff:.2e} > {tolerance:.2e}")
            if not scale_g > tolerance:
                powerless.append(f"{module}.lora_{half}: gradient {scale_g:.2e} <= tolerance {tolerance:.2e}")
    assert not wrong, f"{layout}: {len(wrong)} tensors did not step along the oracle's gradient:\n" + "\n".join(wrong)
    assert not powerless, f"{layout}: the check cannot see these gradients go missing:\n" + "\n".join(powerless)

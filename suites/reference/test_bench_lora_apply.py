"""Benchmark: LoRA on the full-size Flash graph (on the meta device: the module tree, no memory), and the two
mechanisms of Megatron-Bridge's PEFT walk that dominated it, each next to the way the implementation now uses it,
same run.

* ``apply``: ``impl.apply_lora`` with the five main-attention targets on a freshly built Flash graph (absolute).
* ``walk``: Bridge's ``walk`` of that graph with a function that returns each module unchanged, as Bridge calls it
  (``inspect.signature`` asked at every module) and with the signature computed once.
* ``match``: Bridge's ``ModuleMatcher.match`` over every LoRA-able module with the exact names as one pattern each
  (one per layer and target) and as one alternation.

Median of 3 repeats, the two sides interleaved so that load drift hits both, wall and CPU clocks. Never asserts on
time; it asserts that both sides of a mechanism select the same modules.
"""

from __future__ import annotations

import inspect
import re
import statistics
import time

import pytest

pytestmark = pytest.mark.bench

REPEATS = 3
CLOCKS = (("wall", time.perf_counter), ("cpu", time.process_time))
TARGETS = ["wq_a", "wq_b", "wkv", "wo_a", "wo_b"]


def _timed(fn) -> tuple[dict[str, float], object]:
    start = {label: clock() for label, clock in CLOCKS}
    out = fn()
    return {label: clock() - start[label] for label, clock in CLOCKS}, out


def _flash_graph(impl):
    import torch

    from tiny_models.presets import flash_config

    with torch.device("meta"):
        return impl.DeepseekV4NativeModel(impl.V4Config.from_hf(flash_config()))


def _median(samples: dict, key: tuple) -> float:
    return statistics.median(samples[key])


def test_bench_lora_on_the_flash_graph(impl):
    from megatron.bridge.peft.module_matcher import ModuleMatcher
    from megatron.bridge.peft.walk_utils import walk

    from fixtures.data.native_weights import ensure_single_rank_megatron

    ensure_single_rank_megatron(impl)
    samples: dict[tuple[str, str, str], list[float]] = {}

    def record(what: str, side: str, seconds: dict[str, float]) -> None:
        for clock, s in seconds.items():
            samples.setdefault((what, side, clock), []).append(s)

    model = _flash_graph(impl)
    linears = [(n, m) for n, m in model.named_modules() if n and _holds_a_matrix(m)]
    meant = [  # the main attention's projections in every decoder layer (apply_lora leaves the MTP layer alone)
        n
        for n, _ in linears
        if n.startswith("decoder.") and n.split(".")[-2] == "self_attention" and n.split(".")[-1] in TARGETS
    ]
    each = ModuleMatcher(target_modules=[re.escape(n) for n in meant])
    one = ModuleMatcher(target_modules=[f"(?:{'|'.join(re.escape(n) for n in meant)})"])

    def unchanged(module, name=None, prefix=None):
        return module

    def signed_once(module, name=None, prefix=None):
        return module

    signed_once.__signature__ = inspect.signature(signed_once)
    selected = {}
    for _ in range(REPEATS):
        for side, matcher in (("one pattern per name", each), ("one alternation", one)):
            seconds, hits = _timed(lambda m=matcher: [n for n, mod in linears if m.match(mod, n)])
            record("match", side, seconds)
            selected[side] = hits
        for side, fn in (("signature per module", unchanged), ("signature once", signed_once)):
            record("walk", side, _timed(lambda f=fn: walk(model, f))[0])
        fresh = _flash_graph(impl)
        seconds, handle = _timed(lambda g=fresh: impl.apply_lora(g, targets=TARGETS, rank=8, alpha=16.0))
        record("apply", "apply_lora", seconds)
    assert selected["one pattern per name"] == selected["one alternation"] == meant, "the matchers disagree"
    assert sorted(handle.wrapped[0]) == sorted(meant), "apply_lora wrapped other modules than the meant ones"

    print(f"\nFlash graph on meta: {len(linears)} LoRA-able modules, {len(meant)} meant; median of {REPEATS}")
    print(f"{'what':<6} {'clock':<5} {'as Bridge is called':>20} {'as impl calls it':>17} {'speed-up':>9}")
    for what, (before, after) in (
        ("match", ("one pattern per name", "one alternation")),
        ("walk", ("signature per module", "signature once")),
    ):
        for clock, _ in CLOCKS:
            a, b = _median(samples, (what, before, clock)), _median(samples, (what, after, clock))
            print(f"{what:<6} {clock:<5} {a:>19.2f}s {b:>16.2f}s {a / b:>8.1f}x")
    for clock, _ in CLOCKS:
        whole = _median(samples, ("apply", "apply_lora", clock))
        print(f"apply  {clock:<5} apply_lora, the whole: {whole:.2f}s")


def _holds_a_matrix(module) -> bool:
    """The modules a LoRA walk matches on this graph: those holding a 2-D weight of their own (the parallel and
    replicated linears, and the embedding and head, which no target names)."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2

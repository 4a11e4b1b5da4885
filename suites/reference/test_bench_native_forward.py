"""Benchmark: native DeepSeek-V4 forward vs transformers' ``DeepseekV4ForCausalLM`` on the largest tiny preset.
Prints figures (median time, peak RSS growth, ratio); asserts nothing on time."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from fixtures.data.native_weights import ensure_single_rank_megatron, load_hf_into_native
from tiny_models import build_random_model, min_seq_len

pytestmark = pytest.mark.bench


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def test_native_vs_transformers_forward_benchmark(impl):
    """Prints forward time (median of N) and peak RSS growth for the largest tiny preset; asserts nothing on time."""
    ensure_single_rank_megatron(impl)
    native = impl
    hf = build_random_model("tiny-largest", seed=0)
    torch.manual_seed(1)
    model = native.DeepseekV4NativeModel(native.V4Config.from_hf(hf.config)).eval()
    load_hf_into_native(model, hf)
    ids = torch.randint(
        0, hf.config.vocab_size, (2, min_seq_len(hf.config)), generator=torch.Generator().manual_seed(11)
    )
    n = int(os.environ.get("DSV4_BENCH_N", "5"))
    rows = {}
    runs = {"native": lambda: model(ids), "transformers": lambda: hf(ids).logits}
    order = ["native", "transformers"]
    if os.environ.get("DSV4_BENCH_ORDER") == "transformers":
        order.reverse()
    for label, fn in ((k, runs[k]) for k in order):
        with torch.no_grad():
            # Peak RSS growth of the first forward: later ones reuse the allocator's freed pages, so their
            # growth reads ~0 whatever the activations cost. Models run in turn in one process, so the second
            # can reuse pages the first freed: compare orders (DSV4_BENCH_ORDER=transformers) before concluding.
            base = _peak_rss_kib() if _reset_peak_rss() else None
            fn()
            peak = (_peak_rss_kib() - base) / 1024 if base is not None else float("nan")
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        rows[label] = (statistics.median(times), peak)
    print(f"\ntiny-largest forward, batch {tuple(ids.shape)}, median of {n}:")
    for label, (t, mem) in rows.items():
        print(f"  {label:12s} {t * 1e3:8.1f} ms   first-forward peak RSS growth {mem:8.1f} MiB")
    print(f"  native/transformers time ratio {rows['native'][0] / rows['transformers'][0]:.2f}")

"""Benchmark: resolving every name of the full-size Flash manifest, ours (``impl.lookup_official`` /
``impl.lookup_native``) next to Megatron-Bridge 0.6.2's own ``DeepSeekV4Bridge`` registry, same run.

Prints names/second (median of 5 repeats) and the ratio; never asserts on time. Target: >= 10x faster than
Megatron-Bridge and < 0.5 s for the whole manifest in both directions.
"""

import statistics
import time
from collections.abc import Callable, Sequence

import pytest

from tiny_models.manifest import manifest
from tiny_models.presets import flash_config

pytestmark = pytest.mark.bench

REPEATS = 5


def _median_s(fn: Callable[[str], object], names: Sequence[str]) -> tuple[float, int]:
    times, resolved = [], 0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        resolved = sum(fn(n) is not None for n in names)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), resolved


def test_bench_flash_manifest_name_resolution(impl):
    from megatron.bridge.models.deepseek.deepseek_v4_bridge import DeepSeekV4Bridge

    cfg = flash_config()
    official = [s.name for s in manifest(cfg) if not s.name.endswith(".scale")]
    native = [impl.lookup_official(n).native for n in official]
    mb = DeepSeekV4Bridge()
    mb.hf_config = cfg
    reg = mb.mapping_registry()
    mb_native = [m.megatron_param for n in official if (m := reg.hf_to_megatron_lookup(n)) is not None]

    rows = [
        ("official -> native", impl.lookup_official, official, reg.hf_to_megatron_lookup, official),
        ("native -> official", impl.lookup_native, native, reg.megatron_to_hf_lookup, mb_native),
    ]
    total_ours = 0.0
    print(f"\nFlash manifest: {len(official)} official (non-scale) names; median of {REPEATS} repeats")
    print(f"{'direction':<20} {'ours names/s':>14} {'ours s':>8} {'MB names/s':>12} {'MB s':>8} {'speed-up':>9}")
    for label, ours, our_names, theirs, their_names in rows:
        t_ours, n_ours = _median_s(ours, our_names)
        t_mb, n_mb = _median_s(theirs, their_names)
        total_ours += t_ours
        print(
            f"{label:<20} {len(our_names) / t_ours:>14,.0f} {t_ours:>8.3f} {len(their_names) / t_mb:>12,.0f} "
            f"{t_mb:>8.3f} {t_mb / t_ours * len(our_names) / len(their_names):>8.1f}x"
            f"   (resolved: ours {n_ours}/{len(our_names)}, MB {n_mb}/{len(their_names)})"
        )
    print(f"ours, both directions: {total_ours:.3f} s (target < 0.5 s)")
    assert len(official) > 30_000, f"the Flash manifest shrank to {len(official)} names"  # not a timing assert

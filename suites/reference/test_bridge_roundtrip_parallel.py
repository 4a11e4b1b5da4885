"""Official checkpoint -> native chunks (provider-built, TP / EP / PP) -> official state is bit-exact on every rank,
and the loaded sharded model reproduces the transformers oracle's logits."""

import pytest
import torch

import fixtures.asserts as ah
from fixtures.ranks.bridge_rank_fns import RoundTripCase, rank_bridge_roundtrip
from fixtures.runner.multirank import impl_preload, run_ranks
from tiny_models.oracle import write_checkpoint
from tiny_models.presets import get_preset, min_seq_len

pytestmark = [pytest.mark.cpu, pytest.mark.multirank]

PRESET = "tiny-tp"  # every TP / EP split of it is even
#: Units of eps(float32) * max|oracle logits|: the sharded native forward and transformers' are two fp32 forwards
#: of one function, differing by rounding relative to the logits' scale; the same figure as the single-rank
#: property test (suites/reference/test_native_oracle_property.py), whose docstring holds the analysis.
LOGIT_ULPS = 128
FP32_FAMILIES = ("hc_attn_fn", "hc_ffn_base", "hc_head_scale", "attn.attn_sink", "compressor.ape", "ffn.gate.bias")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(PRESET, tmp_path_factory.mktemp("roundtrip"), seed=11)


SEQ = min_seq_len(get_preset(PRESET))
# layout -> (world size, case fields). Combinations need --nproc 4 (or 8); pipeline ranks skip the logits check.
LAYOUTS = {
    "tp2": (2, {"tp": 2, "logits_seq": SEQ}),
    "ep2": (2, {"ep": 2, "logits_seq": SEQ}),
    "pp2": (2, {"pp": 2}),
    "tp2xep2": (4, {"tp": 2, "ep": 2, "logits_seq": SEQ}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2}),
    "ep2xpp2": (4, {"ep": 2, "pp": 2}),
    "tp2xep2xpp2": (8, {"tp": 2, "ep": 2, "pp": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_then_export_is_bit_exact_on_every_rank(impl, ckpt, nproc, layout):
    world, fields = LAYOUTS[layout]
    if world > nproc:
        pytest.skip(f"{layout} needs --nproc {world} (running with --nproc {nproc})")
    case = RoundTripCase(impl_name=impl.name, ckpt_dir=str(ckpt), **fields)
    results = run_ranks(rank_bridge_roundtrip, case, nproc=world, timeout_s=60 * world, preload=impl_preload(impl.name))
    for r in results:
        p = r.payload
        assert not p["mismatches"], f"{layout} rank {r.rank}: round trip not bit-exact:\n  " + "\n  ".join(
            p["mismatches"][:40]
        )
        assert p["totals"]["unmapped"] == 0 and p["totals"]["missing"] == 0, f"{layout} rank {r.rank}: {p['totals']}"
        dtypes = p["dtypes"]
        for name, dtype in dtypes.items():
            if name.endswith("tid2eid"):
                assert dtype == "torch.int64", f"{layout} rank {r.rank}: {name} exported as {dtype}, want int64"
            elif any(name.endswith(f) for f in FP32_FAMILIES) or "hc_" in name:
                assert dtype == "torch.float32", f"{layout} rank {r.rank}: {name} exported as {dtype}, want fp32"
        assert any(n.endswith("tid2eid") for n in dtypes), f"{layout}: checkpoint has no hash layer (preset changed?)"
        if "logit_diff" in p:
            tolerance = ah.ulp_tolerance(torch.float32, ulps=LOGIT_ULPS, scale=p["logit_scale"])
            assert p["logit_diff"] <= tolerance, (
                f"{layout} rank {r.rank}: logits {p['logits_shape']} differ from the transformers oracle by "
                f"max|Δ|={p['logit_diff']:.3e} > {tolerance:.3e} ({LOGIT_ULPS} units of eps(float32) * "
                f"max|logits| {p['logit_scale']:.4g})"
            )
    if fields.get("pp", 1) > 1:
        held = [
            {n.split(".")[2] for n in r.payload["native_filled"] if n.startswith("decoder.layers.")} for r in results
        ]
        stages = {frozenset(h) for h in held}  # TP / EP / DP peers of one stage hold the same layers
        assert all(held) and len(stages) == fields["pp"] and not frozenset.intersection(*stages), (
            f"{layout}: the {fields['pp']} stages must hold disjoint layers, got {sorted(map(sorted, stages))}"
        )


def test_experts_split_three_to_a_rank_come_back_under_their_global_numbers(impl, tmp_path):
    """Expert parallelism names a rank's experts by offset + local index, whatever the count per rank: six experts
    over two ranks (three each, as Pro's 384 over EP=8 is 48 each) come back bit for bit, none shadowing another."""
    from tiny_models.presets import tiny_config, tiny_fields

    ckpt = write_checkpoint(tiny_config(**{**tiny_fields(PRESET), "n_routed_experts": 6}), tmp_path, seed=5)
    case = RoundTripCase(impl_name=impl.name, ckpt_dir=str(ckpt), ep=2)
    for r in run_ranks(rank_bridge_roundtrip, case, nproc=2, timeout_s=120, preload=impl_preload(impl.name)):
        assert not r.payload["mismatches"], f"ep2, three experts a rank, rank {r.rank}: not bit-exact:\n  " + (
            "\n  ".join(r.payload["mismatches"][:20])
        )

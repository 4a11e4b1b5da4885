#!/usr/bin/env python
"""Golden vectors: files any serving engine checks its DeepSeek-V4 LoRA against, with no Python of this project.

``golden/v1/`` holds a tiny V4 base, an adapter per main attention target in each of the three namings, inputs,
and each adapted projection's and attention block's output as PEFT on transformers' ``DeepseekV4ForCausalLM``
computes it (tiny_models/golden.py), with the tolerance rule and each vector's measured defects (manifest.json,
README.md there). Never computed by the implementation.

    .venv/bin/python scripts/golden_vectors.py --write    # regenerate golden/v1/
    .venv/bin/python scripts/golden_vectors.py --check    # exit 1 when golden/v1/ differs from a fresh generation
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from safetensors.torch import load_file, save_file  # noqa: E402  (the repository root goes on the path first)

from dsv4_conformance.judge.oracle import LOGIT_RULE  # noqa: E402
from tiny_models import golden as g  # noqa: E402
from tiny_models.oracle import load_oracle, write_checkpoint  # noqa: E402

#: a change to any value is a new version beside this one, never an edit in place: CIs pin a version
GOLDEN = ROOT / "golden" / "v1"
EPS32, EPS16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
#: float32: the judge's logit rule (two correct float32 computations differ by rounding relative to the values
#: rounded); a projection or one attention block needs far fewer units, so it holds with a wide margin
UNITS32 = LOGIT_RULE.units
#: bfloat16, the projections only: the engine holds the same bf16-exact values and multiplies with float32
#: accumulation, rounding to bf16 at most three times (base output, x @ A, the output after adding the delta):
#: 0.5 unit of eps(bfloat16) each at |output|, plus the x @ A rounding carried through B (0.5 unit at |delta| <=
#: |output|): 2 units at max|expected| bound it; 4 leaves a factor 2 for the summation order
UNITS16 = 4
MODULES = (*g.TARGETS, "attn")


def vector_name(adapter: str, layer: int, module: str) -> str:
    """``base/layers.0.wq_a``: the base's own output; ``wq_a/layers.0.attn``: with the wq_a adapter applied."""
    return f"{adapter}/layers.{layer}.{module}"


def _run(model, target: str | None, ins: dict, layers: int, dtype=torch.float32) -> dict:
    """``target``'s projection (every target's when None, named ``base/...``) and the attention block, per layer,
    computed in ``dtype`` and returned in float32."""
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ins.items()}
    out = {}
    for layer in range(layers):
        for module in g.TARGETS if target is None else (target,):
            x = cast[g.INPUT_OF[module]]
            out[vector_name(target or "base", layer, module)] = g.projection(model, layer, module, x).float()
        attn = g.attention_block(model, layer, cast["hidden_states"], cast["position_ids"])
        out[vector_name(target or "base", layer, "attn")] = attn.float()
    return out


def peft_runs(base, adapter_dir: Path, target: str, ins: dict, dtype=torch.float32) -> tuple[dict, dict]:
    """PEFT's outputs unmerged (its own LoRA forward; none for the grouped ``wo_a``, which its dense forward cannot
    run) and merged (its ``W + s·B@A``)."""
    model = g.peft_model(base, adapter_dir).to(dtype)
    layers = base.config.num_hidden_layers
    unmerged = {} if target == "wo_a" else _run(model, target, ins, layers, dtype)
    return unmerged, _run(model.merge_and_unload(), target, ins, layers, dtype)


def expected_of(unmerged: dict, merged: dict) -> dict:
    """The expected vectors: PEFT's LoRA forward for a plain projection, its merge for wo_a and every block."""
    return {k: v if k.endswith(".attn") else unmerged.get(k, v) for k, v in merged.items()}


def second_of(unmerged: dict, merged: dict, base, target: str, ins: dict) -> dict:
    """The same vectors the other way: a plain target's projection merged and its block unmerged; wo_a's grouped
    definition added unmerged by a hook on the base's module (projection and block)."""
    if target != "wo_a":
        return {k: unmerged[k] if k.endswith(".attn") else v for k, v in merged.items()}
    model, scale = copy.deepcopy(base), g.ALPHA / g.RANK
    for layer, (a, b) in g.factors(base.config, target).items():
        module = model.model.layers[layer].self_attn.o_a_proj
        module.register_forward_hook(g.grouped_lora_hook(a, b, scale, base.config.o_groups))
    return _run(model, target, ins, base.config.num_hidden_layers)


def defect_outputs(base, target: str, ins: dict, tmp: Path) -> dict[str, dict]:
    """Each defect's outputs, computed the way the expected ones are: the rsLoRA scale alpha/sqrt(r) for alpha/r,
    and for the grouped wo_a two groups' rows of lora_B swapped (the adapter dropped: the base's outputs)."""
    layers = g.factors(base.config, target)
    rslora = g.write_adapter(tmp / f"{target}-rslora", "transformers", target, layers, rslora=True)
    found = {"scale alpha/sqrt(r) for alpha/r": expected_of(*peft_runs(base, rslora, target, ins))}
    if target == "wo_a":
        rows, swapped = base.config.o_lora_rank, {}
        for layer, (a, b) in layers.items():
            swapped[layer] = (a, torch.cat([b[rows : 2 * rows], b[:rows], b[2 * rows :]]))
        swap_dir = g.write_adapter(tmp / f"{target}-swapped", "transformers", target, swapped)
        found["groups 0 and 1 swap rows of lora_B"] = expected_of(*peft_runs(base, swap_dir, target, ins))
    return found


def units(a: torch.Tensor, b: torch.Tensor, eps: float) -> float:
    """max|a - b| in units of eps × max|b|."""
    return float((a - b).abs().max()) / (eps * float(b.abs().max()))


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def measure(base, adapters: Path, ins: dict, tmp: Path) -> tuple[dict, dict]:
    """The expected vectors and, per vector, its tolerances and what each defect and each second computation
    measured (in units of eps × max|expected|, as the rule states)."""
    expected = _run(base, None, ins, base.config.num_hidden_layers)
    figures = {name: _figure(name, t, {}, None, None) for name, t in expected.items()}
    for target in g.TARGETS:
        adapter_dir = adapters / "transformers" / target
        unmerged, merged = peft_runs(base, adapter_dir, target, ins)
        want, second = expected_of(unmerged, merged), second_of(unmerged, merged, base, target, ins)
        bf16 = expected_of(*peft_runs(base, adapter_dir, target, ins, torch.bfloat16))
        defects = defect_outputs(base, target, ins, tmp)
        for name, t in want.items():
            dropped = expected[name.replace(f"{target}/", "base/")]
            effects = {"adapter dropped": float((dropped - t).abs().max())}
            effects |= {what: float((out[name] - t).abs().max()) for what, out in defects.items()}
            figures[name] = _figure(name, t, effects, units(second[name], t, EPS32), units(bf16[name], t, EPS16))
        expected |= want
    return expected, figures


def _figure(name: str, t: torch.Tensor, effects: dict, second: float | None, bf16: float | None) -> dict:
    scale = float(t.abs().max())
    tol32 = UNITS32 * EPS32 * scale
    figure = {"max_abs": _sig(scale), "tolerance_float32": _sig(tol32)}
    figure["tolerance_bfloat16"] = None if name.endswith(".attn") else _sig(UNITS16 * EPS16 * scale)
    if not effects:
        return figure
    figure["second_computation_float32_units"] = _sig(second)
    figure["transformers_bfloat16_units"] = _sig(bf16)
    figure["defects"] = {what: _sig(e) for what, e in effects.items()}
    figure["smallest_defect_over_tolerance_float32"] = _sig(min(effects.values()) / tol32)
    return figure


# ------------------------------------------------------------------------------------------------ the files


def versions() -> dict[str, str]:
    import peft
    import safetensors
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "safetensors": safetensors.__version__,
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _inputs_table(ins: dict) -> dict:
    readers = {name: [m for m in MODULES if g.INPUT_OF[m] == name] for name in ins}
    readers["position_ids"] = ["attn"]
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "read_by": readers[name]}
        for name, t in ins.items()
    }


def _manifest(cfg, ins: dict, figures: dict, attn_implementation: str) -> dict:
    return {
        "golden": GOLDEN.name,
        "generator": "scripts/golden_vectors.py",
        "versions": versions(),
        "oracle": {"model": "DeepseekV4ForCausalLM", "dtype": "float32", "attn_implementation": attn_implementation},
        "base": {"seed": g.BASE_SEED, "layer_types": list(cfg.layer_types), "o_groups": cfg.o_groups},
        "lora": {
            "rank": g.RANK,
            "alpha": g.ALPHA,
            "scale": g.ALPHA / g.RANK,
            "use_rslora": False,
            "layers": list(range(cfg.num_hidden_layers)),
            "seeds": {t: g.ADAPTER_SEED + i for i, t in enumerate(g.TARGETS)},
        },
        "inputs": _inputs_table(ins),
        "rule": {
            "tolerance": "units * eps(dtype) * max|expected| over the vector",
            "float32": {"units": UNITS32, "eps": EPS32, "vectors": "all"},
            "bfloat16": {"units": UNITS16, "eps": EPS16, "vectors": "projections (not .attn)"},
        },
        "vectors": dict(sorted(figures.items())),
    }


def generate(out: Path) -> None:
    """Every file of golden/v1 into ``out`` (absent or empty)."""
    cfg = g.golden_config()
    write_checkpoint(cfg, out / "base", seed=g.BASE_SEED, dtype=torch.bfloat16)
    ins = g.inputs(cfg)
    save_file(ins, str(out / "inputs.safetensors"), metadata={"format": "pt"})
    for target in g.TARGETS:
        layers = g.factors(cfg, target)
        for naming in g.NAMINGS:
            g.write_adapter(out / "adapters" / naming / target, naming, target, layers)
    base = load_oracle(out / "base")
    with tempfile.TemporaryDirectory(prefix="golden-defects-") as tmp:
        expected, figures = measure(base, out / "adapters", ins, Path(tmp))
    save_file(
        {k: v.contiguous() for k, v in sorted(expected.items())},
        str(out / "expected.safetensors"),
        metadata={"format": "pt"},
    )
    manifest = _manifest(cfg, ins, figures, base.config._attn_implementation)
    (out / "README.md").write_text(render_readme(manifest))
    manifest["files"] = {rel: sha256(out / rel) for rel in _files(out)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")


# ------------------------------------------------------------------------------------------------ README.md

README = """# Golden vectors {golden}: LoRA on DeepSeek-V4, for any engine

Files a serving engine checks its DeepSeek-V4 LoRA against with its own loader and kernels, no Python of this
project needed: a tiny V4 base, an adapter per main attention target in each of three namings, inputs, and the
outputs that PEFT {peft} on transformers {transformers} (`DeepseekV4ForCausalLM`, float32, {attention} attention,
torch {torch}) computes from them. Generated by
`scripts/golden_vectors.py --write`; `--check` and `suites/reference/test_golden_vectors.py` prove these files are
what the generator computes, that the three namings hold the same factors, and that the defects below miss the
expected outputs by far more than the tolerance. A change to any value is published as a new version beside this
one (`golden/v2/`), so a CI pinned to v1 keeps meaning the same thing.

## Files

| file | holds |
|---|---|
| `base/config.json`, `base/model.safetensors` | the tiny base, a DeepSeek-V4 checkpoint in the official layout (`layers.N.attn.wq_a.weight`, ...): {layers} layers ({layer_kinds}), hidden {hidden}, {heads} heads of {head_dim}, q_lora_rank {q_rank}, o_groups {groups} of o_lora_rank {o_rank}, one MTP layer; weights in bfloat16, the tensors released checkpoints keep in float32 (`attn_sink`, `ape`, `hc_*`) float32 |
| `inputs.safetensors` | the inputs (below): float32 holding bfloat16-exact values, and int64 `position_ids` |
| `adapters/<naming>/<target>/adapter_model.safetensors`, `adapter_config.json` | one LoRA adapter per target (`wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`) on that target in every layer ({adapter_layers}), rank {rank}, lora_alpha {alpha} (scale alpha/r = {scale:g}, no rsLoRA), non-zero lora_A and lora_B, float32 holding bfloat16-exact values; the same values in each naming |
| `expected.safetensors` | the expected outputs (below), float32 |
| `manifest.json` | the versions used, every file's sha256, the rule, and per vector its tolerances, its defects' measured effects and the agreement of two correct computations |

Inputs, one sequence of {tokens} tokens at positions 0..{last}:

| tensor | shape | read by |
|---|---|---|
{input_rows}

## The namings

An adapter's tensors are `base_model.model.<module>.lora_A.weight` [{rank}, in] and `.lora_B.weight` [out, {rank}],
PEFT's layout; `<module>` per naming (N the layer):

| naming | module | `target_modules` | who reads it |
|---|---|---|---|
| `transformers` | `model.layers.N.self_attn.{{q_a_proj,q_b_proj,kv_proj,o_a_proj,o_b_proj}}` | an exact regex (never the compressors' `kv_proj` nor the indexer's `q_b_proj`) | PEFT on transformers |
| `official` | `layers.N.attn.{{wq_a,wq_b,wkv,wo_a,wo_b}}` | the leaf, e.g. `["wq_a"]` | vLLM (the checkpoint's names) |
| `sglang` | `model.layers.N.self_attn.{{wq_a,wq_b,wkv,wo_a,wo_b}}` | the leaf | SGLang's module tree |

`wo_a` is grouped: its weight [{groups} × {o_rank}, K] holds one [{o_rank}, K] block per group, K = heads × head_dim /
o_groups = {group_in}. Its lora_A [{rank}, K] is shared by the groups; group g takes rows g·{o_rank} ... (g+1)·{o_rank} − 1
of lora_B: y_g = x_g·W_gᵀ + s·(x_g·Aᵀ)·B_gᵀ, exactly what PEFT's merge W + s·B@A gives. Input `o_grouped`
[1, T, {groups}, K] is the attention output split into groups (group g: columns g·K ... (g+1)·K − 1).

## The expected outputs

* `base/layers.N.<target>` and `base/layers.N.attn`: the base's own outputs, no adapter (check the base first);
* `<target>/layers.N.<target>`: that projection with the `<target>` adapter: its base output plus s·B·A·x
  (PEFT's own LoRA forward; for `wo_a`, which PEFT can run only merged, its merged weight);
* `<target>/layers.N.attn`: layer N's attention block with the `<target>` adapter merged into its weights.

The attention block is transformers' `DeepseekV4Attention` of layer N as the model calls it on a first forward:
input `hidden_states` (what the block receives after the layer's attn_norm), `position_ids`, an empty cache, the
causal sliding-window mask; it includes the compressor and the indexer (CSA layer), the sinks, the rotary embedding
and its inverse on the output, `wo_a` and `wo_b`, and ends before the hyper-connection. Projection outputs keep
transformers' shapes: `wo_a`'s is [1, T, {groups}, {o_rank}] (group-major).

## How an engine checks itself

1. Load `base/` as a DeepSeek-V4 checkpoint and `adapters/<your naming>/<target>/` as a LoRA adapter, in your
   engine's own code, in float32 for the float32 rule (`config.json` says bfloat16, the weights' storage type);
2. feed each input to the module it names (or run layer N's attention on `hidden_states` at `position_ids`);
3. for every vector you can produce, pass when max|yours − expected| <= the tolerance below (each vector's value
   is in `manifest.json`, `vectors.<name>.tolerance_float32` / `tolerance_bfloat16`); check `base/...` first.

## The tolerance rule

tolerance = units × eps(dtype) × max|expected| over the vector.

* float32 (true float32: TF32 off): {units32} units, eps = 2^-23. Two correct float32 computations differ by
  rounding relative to the values rounded (a different summation order, merged or unmerged LoRA); {units32} is the
  suite's logit rule, wide for one block. Measured: PEFT's LoRA forward against its merge, and the grouped
  definition added unmerged against PEFT's merge, agree within {second} units on every vector.
* bfloat16, projections only: {units16} units, eps = 2^-7. Every value is bfloat16-exact, so an engine in bfloat16
  holds the reference's values (the scale {scale:g} is a power of two: folded into lora_B it rounds nothing); with
  float32 accumulation it rounds to bfloat16 at most three times (the base output, x·Aᵀ, the output after the
  delta is added): 0.5 unit each at |output|, plus the x·Aᵀ rounding carried through B (0.5 unit at
  |delta| <= |output|), 2 units in all, doubled for the summation order. transformers itself in bfloat16 (PEFT's LoRA forward; for `wo_a` the merge, rounded to bfloat16) lands within {bf16_proj} units.
* bfloat16, attention blocks: no rule. The block rounds at a dozen points between norms, and the CSA layer's
  indexer picks its top-k entries, a discrete choice that bfloat16 rounding may flip. transformers itself in
  bfloat16 lands within {bf16_attn} units (for orientation, not a bound).

## What each vector catches

Each adapter's vectors miss the expected outputs by these (manifest.json: `defects` per vector), the smallest
effect over the vectors ÷ that vector's tolerance:

| adapter | defect | least effect ÷ float32 tolerance | least effect ÷ bfloat16 tolerance (projections) |
|---|---|---|---|
{defect_rows}
"""


def _defect_rows(vectors: dict) -> str:
    rows = []
    for target in g.TARGETS:
        mine = {n: v for n, v in vectors.items() if n.startswith(f"{target}/")}
        for what in next(iter(mine.values()))["defects"]:
            r32 = min(v["defects"][what] / v["tolerance_float32"] for v in mine.values())
            r16 = min(v["defects"][what] / v["tolerance_bfloat16"] for v in mine.values() if v["tolerance_bfloat16"])
            rows.append(f"| `{target}` | {what} | {_two_digits(r32)} | {_two_digits(r16)} |")
    return "\n".join(rows)


def _two_digits(x: float) -> str:
    return f"{float(f'{x:.2g}'):,.0f}"


def _worst(vectors: dict, key: str, attn: bool) -> str:
    values = [v[key] for n, v in vectors.items() if key in v and n.endswith(".attn") == attn]
    return f"{max(values):.2g}"


def render_readme(manifest: dict) -> str:
    """golden/v1/README.md from the manifest alone (so --check can hold one to the other)."""
    cfg, vectors, ins = g.golden_config(), manifest["vectors"], manifest["inputs"]
    tokens = ins["position_ids"]["shape"][1]
    adapted = {n: v for n, v in vectors.items() if not n.startswith("base/")}
    second = max(v["second_computation_float32_units"] for v in adapted.values())
    rows = [f"| `{n}` | {i['shape']} {i['dtype']} | {', '.join(i['read_by'])} |" for n, i in ins.items()]
    return README.format(
        golden=manifest["golden"],
        attention=manifest["oracle"]["attn_implementation"],
        **manifest["versions"],
        layers=cfg.num_hidden_layers,
        layer_kinds="; ".join(cfg.layer_types),
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        q_rank=cfg.q_lora_rank,
        groups=cfg.o_groups,
        o_rank=cfg.o_lora_rank,
        group_in=cfg.num_attention_heads * cfg.head_dim // cfg.o_groups,
        adapter_layers=", ".join(map(str, manifest["lora"]["layers"])),
        rank=manifest["lora"]["rank"],
        alpha=manifest["lora"]["alpha"],
        scale=manifest["lora"]["scale"],
        tokens=tokens,
        last=tokens - 1,
        input_rows="\n".join(rows),
        units32=manifest["rule"]["float32"]["units"],
        units16=manifest["rule"]["bfloat16"]["units"],
        second=f"{second:.2g}",
        bf16_proj=_worst(adapted, "transformers_bfloat16_units", attn=False),
        bf16_attn=_worst(adapted, "transformers_bfloat16_units", attn=True),
        defect_rows=_defect_rows(adapted),
    )


# ------------------------------------------------------------------------------------------------ --check

#: figures that measure rounding (they differ between machines by rounding too): checked present, not equal
MEASURED = frozenset({"second_computation_float32_units", "transformers_bfloat16_units"})
#: the manifest's rounded figures (3 significant digits) agree within this between machines
FIGURE_RTOL = 2e-2


def _manifest_diff(committed, fresh, where: str = "manifest.json") -> list[str]:
    if isinstance(committed, dict) and isinstance(fresh, dict):
        if committed.keys() != fresh.keys():
            return [f"{where}: keys {sorted(committed.keys() ^ fresh.keys())} differ"]
        skip = MEASURED | {"versions", "files"}  # versions: reported; files: checked against the files themselves
        return [p for k in committed if k not in skip for p in _manifest_diff(committed[k], fresh[k], f"{where}.{k}")]
    if isinstance(committed, float) and isinstance(fresh, float):
        return [] if math.isclose(committed, fresh, rel_tol=FIGURE_RTOL) else [f"{where}: {committed} != {fresh}"]
    return [] if committed == fresh else [f"{where}: {committed!r} committed, {fresh!r} fresh"]


def _file_diff(committed: Path, fresh: Path, rel: str) -> list[str]:
    if rel.endswith("config.json") and rel.startswith("base/"):
        a, b = (json.loads(p.read_text()) for p in (committed, fresh))
        a.pop("transformers_version", None), b.pop("transformers_version", None)  # the writer's version only
        return [] if a == b else [f"{rel}: differs"]
    if rel != "expected.safetensors":
        return [] if committed.read_bytes() == fresh.read_bytes() else [f"{rel}: differs"]
    a, b = load_file(str(committed)), load_file(str(fresh))
    if a.keys() != b.keys():
        return [f"{rel}: tensors {sorted(a.keys() ^ b.keys())} differ"]
    # the oracle's own arithmetic may round differently on another machine: the vectors hold within the rule
    problems = []
    for name in sorted(a):
        tol = UNITS32 * EPS32 * float(b[name].abs().max())
        if a[name].shape != b[name].shape or float((a[name] - b[name]).abs().max()) > tol:
            problems.append(f"{rel}: {name} is not within the float32 rule of a fresh computation")
    return problems


def compare(committed: Path, fresh: Path) -> list[str]:
    """Why ``committed`` is not what a fresh generation (``fresh``) is; empty when it is."""
    if not (committed / "manifest.json").is_file():
        return [f"{committed}: no manifest.json"]
    have, want = set(_files(committed)), set(_files(fresh))
    problems = [f"{rel}: missing" for rel in sorted(want - have)] + [f"{rel}: not generated" for rel in have - want]
    for rel in sorted(have & want - {"README.md"}):
        problems += _file_diff(committed / rel, fresh / rel, rel)
    manifest = json.loads((committed / "manifest.json").read_text())
    problems += _manifest_diff(manifest, json.loads((fresh / "manifest.json").read_text()))
    problems += [
        f"{rel}: its sha256 is not manifest.json's"
        for rel in sorted(have)
        if manifest["files"].get(rel) != sha256(committed / rel)
    ]
    if (committed / "README.md").is_file() and (committed / "README.md").read_text() != render_readme(manifest):
        problems.append("README.md: is not what manifest.json renders")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the golden vectors")
    mode.add_argument("--check", action="store_true", help="exit 1 when they differ from a fresh generation")
    parser.add_argument(
        "--dir", type=Path, default=GOLDEN, help=f"where they live (default {GOLDEN.relative_to(ROOT)})"
    )
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        fresh = Path(tmp) / "v1"
        generate(fresh)
        if args.write:
            shutil.rmtree(args.dir, ignore_errors=True)
            shutil.copytree(fresh, args.dir)
            print(f"golden_vectors: wrote {args.dir} ({len(_files(args.dir)) + 1} files)")
            return 0
        problems = compare(args.dir, fresh)
        theirs = json.loads((args.dir / "manifest.json").read_text()).get("versions") if not problems else None
    if problems:
        print("golden_vectors: stale; run scripts/golden_vectors.py --write\n  " + "\n  ".join(problems))
        return 1
    if theirs != versions():
        print(f"golden_vectors: note: generated with {theirs}, checked with {versions()}")
    print(f"golden_vectors: {args.dir} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())

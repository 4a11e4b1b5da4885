#!/usr/bin/env python
"""Print the producer matrices: producer x version x target spec, what verify-adapter finds in the adapter the
producer's own code makes, and what each consumer would apply (fixtures/data/producers.py: stock PEFT;
fixtures/data/producers_bridge.py: Megatron-Bridge's own save_hf_adapter on the native graph).

    .venv/bin/python scripts/producer_matrix.py            # print the markdown table
    .venv/bin/python scripts/producer_matrix.py --write    # put it into docs/producers.md between the markers
    .venv/bin/python scripts/producer_matrix.py --check    # exit 1 when docs/producers.md's table differs
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fixtures.contract.generated import script_parser  # noqa: E402
from fixtures.data.producers import PEFT_SPECS, PRODUCER_MATRIX, matrix_rows, peft_model, render_matrix  # noqa: E402
from fixtures.data.producers_bridge import BRIDGE_MATRIX  # noqa: E402
from fixtures.runner.impl_loader import resolve_impl_name  # noqa: E402  (the repository root goes on the path first)
from tiny_models.oracle import write_checkpoint  # noqa: E402


def main() -> int:
    parser = script_parser(__doc__, "docs/producers.md")
    parser.add_argument("--impl", default=None, help="implementation module (default: impl or $DSV4_IMPL)")
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr), tempfile.TemporaryDirectory(prefix="producer-matrix-") as tmp:
        base = write_checkpoint("tiny-mixed", Path(tmp) / "base")
        adapters = {}
        for name, spec in PEFT_SPECS.items():
            peft_model(base, spec).save_pretrained(str(Path(tmp) / name))
            adapters[name] = Path(tmp) / name
        name = resolve_impl_name(args.impl)
        table = render_matrix(matrix_rows(name, base, adapters))
        bridge_table = render_matrix(_bridge_rows(name, base, Path(tmp) / "bridge"))
    codes = [
        section.apply(t, write=args.write, check=args.check)
        for section, t in ((PRODUCER_MATRIX, table), (BRIDGE_MATRIX, bridge_table))
    ]
    return max(codes)


def _bridge_rows(name: str, base: Path, out: Path):
    """Megatron-Bridge's own save_hf_adapter on the native graph (fixtures/data/producers_bridge.py)."""
    from fixtures.data.producers_bridge import bridge_adapters, bridge_version, trained_native
    from fixtures.runner.impl_loader import load_impl

    impl = load_impl(name)
    model, lora = trained_native(impl)
    made = bridge_adapters(impl, base, model, lora, out)
    return matrix_rows(name, base, made, producer="Megatron-Bridge save_hf_adapter", version=bridge_version())


if __name__ == "__main__":
    sys.exit(main())

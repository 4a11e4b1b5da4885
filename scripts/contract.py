#!/usr/bin/env python
"""Print the contract an implementation provides (every ``impl.NAME`` the suites read; fixtures/contract/suite_contract.py)
and the capabilities a partial implementation may declare (fixtures/contract/capabilities.py); the driver contract
of the conformance suites (fixtures/contract/driver_page.py) into docs/driver.md.

.venv/bin/python scripts/contract.py            # print the two markdown tables
.venv/bin/python scripts/contract.py --write    # put them into docs/reference_api.md between their markers
.venv/bin/python scripts/contract.py --check    # exit 1 when docs/reference_api.md's tables differ
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.contract.capabilities import CAPABILITY_DOC, render_capabilities  # noqa: E402
from fixtures.contract.driver_page import DRIVER_DOC, render_driver_page  # noqa: E402
from fixtures.contract.generated import script_parser  # noqa: E402
from fixtures.contract.suite_contract import CONTRACT_DOC, contract_names, optional_names, render_contract  # noqa: E402  (the root goes first)


def main() -> int:
    parser = script_parser(__doc__, "docs/reference_api.md")
    args = parser.parse_args()
    contract = CONTRACT_DOC.apply(
        render_contract(contract_names(), optional_names()), write=args.write, check=args.check
    )
    capabilities = CAPABILITY_DOC.apply(render_capabilities(), write=args.write, check=args.check)
    driver = DRIVER_DOC.apply(render_driver_page(), write=args.write, check=args.check)
    return max(contract, capabilities, driver)


if __name__ == "__main__":
    sys.exit(main())

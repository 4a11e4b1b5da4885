"""``python -m impl.cli``: the ``dsv4-lora`` command line."""

import sys

from impl.cli.main import main

sys.exit(main())

"""Conversion: what a checkpoint is and how its names meet the native graph.

V4 detection and the fused-kernel hardware gates (``detect``, ``hardware``), THE checkpoint-name table
(``mapping``), the conversion-only Megatron-Bridge bridge with strict load and export (``bridge``), the
mapping coverage report (``coverage``) and pipeline layouts (``pipeline``). Importing this package imports
nothing else: ``bridge`` needs megatron (``impl`` installs the CPU compat layer first), the rest do not."""

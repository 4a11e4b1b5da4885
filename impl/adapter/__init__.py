"""Adapter: from trained LoRA shards to a published, portable PEFT directory.

Gathering shards across TP/PP (``gather``, needs megatron), naming dialects (``dialects``), the base
fingerprint (``fingerprint``), building the PEFT tensors and config from a gathered state (``build``), and the
fail-closed, collective, atomic export: its protocol (``export``), its ordered phases (``phases``), the files,
marker and crash recovery (``files``), the re-read of the staged file (``staged``) and the checks of an exported
directory (``validation``). Exporter ranks import only this room, never megatron; importing this package imports
nothing else.
"""

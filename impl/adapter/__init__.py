"""Adapter: from trained LoRA shards to a published, portable PEFT directory.

Modules: ``gather`` across TP/PP, which needs megatron; ``dialects``; the base ``fingerprint``; ``build`` of the PEFT
tensors and config; and the fail-closed, collective, atomic export: ``export`` its protocol, ``phases`` in order,
``files`` with marker and crash recovery, ``staged`` re-reading the file, ``validation`` checking a directory.
Exporter ranks import only this room, never megatron; importing this package imports nothing else."""

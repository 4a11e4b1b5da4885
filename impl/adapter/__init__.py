"""Adapter: from trained LoRA shards to a published, portable PEFT directory.

Gathering shards across TP/PP (``gather``, needs megatron), naming dialects (``dialects``), the base
fingerprint (``fingerprint``) and the fail-closed, collective, atomic export (``export``). Exporter ranks
import only this room, never megatron; importing this package imports nothing else.
"""

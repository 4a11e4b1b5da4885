"""The native DeepSeek-V4 graph on Megatron-Core: config, attention stack, hyper-connections, MoE, layers, model,
the provider (TP/EP/PP chunks, PEFT before DDP) and the manual pipeline step.

Importing this package imports nothing: ``config`` is plain Python (``verify-adapter`` reads it without megatron);
every module that imports megatron installs the CPU compat layer first (``impl.compat.active``).
"""

"""LoRA: which modules are targets and how they are wrapped.

The target vocabulary and qualifier (``targets``), the wrappers on the native graph including the grouped
``wo_a`` (``wrappers``, needs megatron), and the consumer side: PEFT loading with the grouped layer
registered (``peft_loader``, no megatron). Importing this package imports nothing else.
"""

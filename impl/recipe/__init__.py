"""Recipes: the DeepSeek-V4-Flash LoRA recipe and its tiny twin (``flash_lora``), and the per-rank memory model
that says whether a recipe's layout fits (``memory``). Plain data and arithmetic: importing them does not import
megatron (the launch scripts build recipes cheaply); the memory model builds stages on the meta device when asked."""

"""The conversion bridge Megatron-Bridge dispatches to: strict load, export and merged export of a V4 checkpoint,
and provider dispatch. It sits above the graph and the adapters it assembles. Importing this package imports nothing.
"""

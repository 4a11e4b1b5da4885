"""The conformance contract for LoRA on DeepSeek-V4, and its judge.

``dsv4_conformance.driver``: what the suites ask of an implementation (one :class:`~dsv4_conformance.driver.Driver`
subclass per implementation; ``docs/driver.md``). ``dsv4_conformance.judge``: what decides whether an adapter an
implementation exported is right, from its files and transformers + PEFT alone; it imports no implementation.
"""

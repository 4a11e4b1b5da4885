"""The reference implementation's driver, where the other implementations' drivers live: it is installed with the
implementation (``impl.driver``), so ``dsv4-lora qualify`` runs it by default."""

from impl.driver import DRIVER

__all__ = ["DRIVER"]

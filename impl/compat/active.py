"""Importing this module installs the CPU compatibility layer; modules that import megatron import it first."""

from impl.compat import install

REPORT = install()

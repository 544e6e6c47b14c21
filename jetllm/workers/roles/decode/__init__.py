"""The decode role: generate, with long prompts prefilled by prefill workers (role.py)."""

from .role import DecodeRole

__all__ = ["DecodeRole"]

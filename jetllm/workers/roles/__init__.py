"""One module per worker role."""

from .generate import GenerateRole

__all__ = ["GenerateRole"]

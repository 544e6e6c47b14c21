"""One module per worker role."""

from .generate import GenerateRole, Outcome

__all__ = ["GenerateRole", "Outcome"]

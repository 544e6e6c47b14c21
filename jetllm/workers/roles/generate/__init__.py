"""The aggregated role: prefill and decode of a generate job on this worker's engine, with the
request's history (continuation after a dead worker, migration budget, early start) its own."""

from .role import GenerateRole
from .stream import Outcome

__all__ = ["GenerateRole", "Outcome"]

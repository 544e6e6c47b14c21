"""The worker runtime, one module per role, and the engine adapters."""

from .runtime import Worker, WorkerConfig

__all__ = ["Worker", "WorkerConfig"]

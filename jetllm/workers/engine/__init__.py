"""Engines behind one protocol; vLLM is imported only when a VllmEngine is started."""

from .base import ChoiceDelta, Engine, EngineFacts, EngineLoad, EngineStep, KvEventSource
from .options import EngineOptions

__all__ = ["ChoiceDelta", "Engine", "EngineFacts", "EngineLoad", "EngineOptions", "EngineStep", "KvEventSource"]

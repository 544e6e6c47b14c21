"""Engines behind one protocol; vLLM is imported only when a VllmEngine is started."""

from .base import (
    ChoiceDelta,
    Engine,
    EngineAdapter,
    EngineFacts,
    EngineLoad,
    EnginePrompt,
    EngineStep,
    KvEventSource,
    LoraFacts,
    PromptEmbeds,
)
from .options import EngineOptions

__all__ = [
    "ChoiceDelta",
    "Engine",
    "EngineAdapter",
    "EngineFacts",
    "EngineLoad",
    "EngineOptions",
    "EnginePrompt",
    "EngineStep",
    "KvEventSource",
    "LoraFacts",
    "PromptEmbeds",
]

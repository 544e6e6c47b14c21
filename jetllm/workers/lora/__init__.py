"""LoRA adapters on a worker: fetching and caching their files, validating them, and keeping the
engine's adapters in step with the model's desired set."""

from .manager import LoraManager, LoraSettings, adapter_id

__all__ = ["LoraManager", "LoraSettings", "adapter_id"]

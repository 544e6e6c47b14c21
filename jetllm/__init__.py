"""jetllm: LLM inference jobs on NATS JetStream, served by stateless vLLM workers.

`from jetllm import Client` is the producer API of `jetllm.producer`, imported on first use: the
watchdog (`python -m jetllm.reaper`) and readers of `jetllm.schemas` load no NATS client.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PRODUCER = frozenset({"Client", "Completion", "LoraAdmin", "QueuePolicy", "embeds_prompt"})

if TYPE_CHECKING:
    from .producer import Client, Completion, LoraAdmin, QueuePolicy, embeds_prompt


def __getattr__(name: str) -> Any:
    if name in _PRODUCER:
        from . import producer

        return getattr(producer, name)
    raise AttributeError(f"module 'jetllm' has no attribute {name!r}")


__all__ = ["Client", "Completion", "LoraAdmin", "QueuePolicy", "__version__", "embeds_prompt"]

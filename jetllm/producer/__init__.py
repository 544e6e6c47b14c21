"""The producer's side: submit jobs and read their frames and results (Client), and the admin
readers and verbs of the fleet (registry, fan-out, dead letters, traces, KV events, LoRA)."""

from ..subjects.policy import QueuePolicy
from .client import Client
from .completion import Completion
from .embeds import embeds_prompt
from .lora import LoraAdmin

__all__ = ["Client", "Completion", "LoraAdmin", "QueuePolicy", "embeds_prompt"]

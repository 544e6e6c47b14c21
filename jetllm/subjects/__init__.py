"""Subject and stream names, stream/consumer set-up, and the producer client."""

from .client import Client
from .completion import Completion
from .embeds import embeds_prompt
from .names import Names, decode_token, encode_token
from .setup import QueuePolicy, check_server, ensure_consumer, ensure_streams

__all__ = [
    "Client",
    "Completion",
    "Names",
    "QueuePolicy",
    "check_server",
    "decode_token",
    "embeds_prompt",
    "encode_token",
    "ensure_consumer",
    "ensure_streams",
]

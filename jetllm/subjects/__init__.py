"""The NATS plumbing every side shares: subject and stream names, stream, consumer and bucket set-up,
the codec, connections and direct subscriptions. It knows nothing of producers or workers."""

from .names import Names, decode_token, encode_token
from .setup import QueuePolicy, check_server, ensure_consumer, ensure_streams

__all__ = [
    "Names",
    "QueuePolicy",
    "check_server",
    "decode_token",
    "encode_token",
    "ensure_consumer",
    "ensure_streams",
]

"""The NATS plumbing every side shares: subject and stream names, stream, consumer and bucket set-up,
the codec, connections and direct subscriptions. It knows nothing of producers or workers."""

from .consumers import ensure_consumer
from .names import Names, decode_token, encode_token
from .policy import QueuePolicy
from .server import check_server
from .setup import ensure_streams

__all__ = [
    "Names",
    "QueuePolicy",
    "check_server",
    "decode_token",
    "encode_token",
    "ensure_consumer",
    "ensure_streams",
]

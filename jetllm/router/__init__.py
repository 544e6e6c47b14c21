"""KV-aware routing (docs/routing.md): an index of which instance holds which prefix-cache blocks,
fed by the KV-event stream, and a cost per candidate that places each job."""

from .cost import Candidate, Choice, Weights, choose
from .hashing import BlockHasher
from .index import BlockIndex
from .publish import publish_directed
from .router import Placement, Router

__all__ = [
    "BlockHasher",
    "BlockIndex",
    "Candidate",
    "Choice",
    "Placement",
    "Router",
    "Weights",
    "choose",
    "publish_directed",
]

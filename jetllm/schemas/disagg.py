"""Prefill/decode handoff: what a decode worker asks a prefill worker, and where the KV blocks are.

A decode worker renders the prompt, publishes a `PrefillRequest` on the prefill queue and waits
on its reply subject for `Prefilled` (or an ErrorFrame). The blocks travel on their own subject
(`Names.kv_live(transfer_id)`, or `Names.kv_blocks(transfer_id)` when they are stored): first a
`KvBlocksHeader`, then the blocks in order, each block split into chunks that fit the server's
max payload, or several to a message. `Prefilled.checksums` are taken from the bytes the prefill
engine wrote, so the decode worker checks every block it received against a digest that came by
another path. With one of vLLM's own connectors (`Prefilled.connector`) the
same two messages pass, and the connectors move the bytes themselves.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from .common import Command, Report, Tolerant
from .generate import RequestId, TokensPrompt

Checksum = Literal["sha256-128", "blake3-128"]
"""How each block's checksum is taken: sha256 or blake3, cut to their first 128 bits (32 hex
digits). blake3 runs ~1.5-2x faster on these CPUs; both are cryptographic."""

TransferId = Annotated[str, Meta(pattern="^[0-9a-f]{16,64}$")]
"""A subject token and a file name: nothing else may pass (a decode worker makes it, uuid4 hex)."""


class PrefillRequest(Command, kw_only=True):
    """A job on `jobs.prefill.<model>`: compute the prompt's KV cache and publish its full blocks."""

    request_id: RequestId
    """`<generate request id>:prefill:<n>`: the request it serves, and which try."""
    reply_to: str
    model: str
    prompt: TokensPrompt
    """Rendered by the decode worker, so both engines see exactly the same tokens."""
    transfer_id: TransferId
    """Where the blocks go: hex, 16-64 characters (the subject token of `kv_live` and `kv_blocks`)."""
    expires_at: Annotated[float, Meta(ge=0)]
    """Unix time after which nobody waits for the blocks: an older job is refused, and the block
    stream forgets blocks once they are this old anyway."""
    adapter: str | None = None
    packed: bool = False
    """The decode worker reads chunk messages that hold several whole blocks (`Prefilled.
    blocks_per_message`); without it (older decode workers) every message holds one block or less."""
    checksum: Checksum = "sha256-128"
    """How the prefill worker checksums the blocks (`KvBlocksHeader.checksum` says it did): the
    decode worker asks for the fastest one it can check. Older prefill workers refuse the field,
    as they refuse `packed`: upgrade prefill workers first."""
    window: Annotated[int, Meta(ge=0)] = 0
    """Bytes the prefill worker may have published beyond what the decode worker confirmed
    (`KvReceived`); at most one message more goes. 0: publish without waiting (older decode
    workers, which send no receipts). Older prefill workers refuse the field, as `packed`."""
    stored: bool = True
    """Publish the blocks to the block stream (`Names.kv_blocks`), where the decode worker can
    read back what its subscription missed, or, when false, straight to the decode worker
    (`Names.kv_live`), stored nowhere: cheaper for the server and both workers, and a transfer
    that arrives incomplete is prefilled by the decode worker itself. Older prefill workers
    refuse the field, as `packed`."""


class KvLayer(Tolerant, kw_only=True):
    """One KV-cache tensor of the engine, as one block of it is laid out."""

    name: str
    dtype: str
    """torch dtype name without the prefix: float32, bfloat16, float16, ..."""
    block_shape: list[int]
    """The tensor's shape with the block dimension left out."""
    block_dim: int
    """Where the block dimension sits in the engine's tensor."""


class KvBlocksHeader(Tolerant, kw_only=True):
    """What the blocks are: enough for a decode engine to refuse blocks it cannot use."""

    block_size: int
    """Tokens per block."""
    num_tokens: int
    """Tokens covered: num_blocks * block_size (full blocks only)."""
    num_blocks: int
    block_bytes: int
    """Bytes of one block: every layer's slice of it, in `layers` order."""
    prompt_digest: str
    """blake2b-128 of the covered prompt tokens (int32 little-endian): blocks of another prompt
    never load."""
    layers: list[KvLayer]
    checksum: Checksum = "sha256-128"
    """How `Prefilled.checksums` were taken (absent from older prefill workers: sha256-128)."""


class KvReceived(Report, kw_only=True):
    """On `Names.kv_received(transfer_id)`: how much of the transfer the decode worker has received,
    so the prefill worker never runs more than `PrefillRequest.window` ahead of it (a server cuts a
    connection that falls more than its max_pending behind)."""

    transfer_id: str
    received: int
    """Bytes of every message on the block subject so far (the header's included)."""


class Prefilled(Report, kw_only=True, tag_field="kind", tag="prefilled"):
    """The prefill worker's answer: the blocks are published and checked."""

    request_id: str
    transfer_id: str
    worker: str
    header: KvBlocksHeader
    checksums: list[str]
    """Each block's checksum, in order, taken as `header.checksum` says (first 128 bits, hex)."""
    chunk_bytes: int
    """Largest chunk a block was split into (the last chunk of a block may be shorter)."""
    messages: int
    """Messages on the block subject: the header plus every chunk."""
    expires_at: float
    prefill_ms: float = 0.0
    publish_ms: float = 0.0
    blocks_per_message: Annotated[int, Meta(ge=1)] = 1
    """Whole blocks in each chunk message (the last one may hold fewer); 1: each block is split
    into chunks of at most `chunk_bytes`."""
    connector: str = "jetllm"
    """The KV connector that moved the blocks: `jetllm` (through NATS, as above), or the name of
    one of vLLM's own (e.g. NixlConnector), which moved them itself: then no block is on the
    block subject (`messages` 0) and the decode engine needs the same connector. A decode worker
    whose connector differs prefills the prompt itself."""
    kv_params: dict[str, Any] | None = None
    """What the prefill engine's connector returned for the decode engine (vLLM's
    `kv_transfer_params`, e.g. NIXL's remote engine and block ids); None with jetllm's."""

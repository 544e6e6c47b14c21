"""How a transfer's blocks are cut into messages: pure arithmetic both sides agree on.

A message never holds part of two blocks, so each block can be checked on its own. Blocks
larger than a message are split into pieces of at most `chunk` bytes; smaller blocks travel
several to a message (when the decode worker said it reads such messages), since every message
costs both clients and the server a fixed price that 64 KiB blocks (the tiny model's) pay a
thousand times for 64 MB.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..subjects.codec import HEADER_MARGIN

MESSAGE_BYTES = 1 << 20
"""Largest message packed of several blocks. nats-py waits for its socket to drain whenever more
than its pending buffer (2 MiB by default) is queued, so messages of half that keep publishing
pipelined; 8 MiB messages were slower on both sides (docs/benchmarks.md)."""


def chunk_size(max_payload: int) -> int:
    """Largest piece of a block that is split: what the server takes, less room for headers."""
    return max(4096, max_payload - HEADER_MARGIN)


def blocks_per_message(block_bytes: int, chunk: int, packed: bool) -> int:
    if not packed or block_bytes <= 0:
        return 1
    return max(1, min(chunk, MESSAGE_BYTES) // block_bytes)


def chunks_per_block(block_bytes: int, chunk: int) -> int:
    return max(1, -(-block_bytes // chunk))


def message_count(num_blocks: int, block_bytes: int, chunk: int, per_message: int) -> int:
    """The header plus every chunk."""
    if per_message > 1:
        return 1 + -(-num_blocks // per_message)
    return 1 + num_blocks * chunks_per_block(block_bytes, chunk)


def chunks(
    view: memoryview, block_bytes: int, num_blocks: int, chunk: int, per_message: int = 1
) -> Iterator[memoryview]:
    if per_message > 1:
        for j in range(0, num_blocks, per_message):
            yield view[j * block_bytes : min(j + per_message, num_blocks) * block_bytes]
        return
    for j in range(num_blocks):
        base = j * block_bytes
        for off in range(0, block_bytes, chunk):
            yield view[base + off : base + min(off + chunk, block_bytes)]


def blocks(
    messages: list[bytes], num_blocks: int, block_bytes: int, chunk: int, per_message: int
) -> Iterator[bytes | memoryview]:
    """Each block rebuilt from its chunks (`messages` without the header), in order; one of the
    wrong size ends the iteration with ValueError naming it."""
    if per_message > 1:
        for i, data in enumerate(messages):
            view = memoryview(data)
            first = i * per_message
            count = min(per_message, num_blocks - first)
            if len(view) != count * block_bytes:
                raise ValueError(f"block {first + 1} of {num_blocks} is cut short")
            for j in range(count):
                yield view[j * block_bytes : (j + 1) * block_bytes]
        return
    per_block = chunks_per_block(block_bytes, chunk)
    for j in range(num_blocks):
        block = b"".join(messages[j * per_block : (j + 1) * per_block])
        if len(block) != block_bytes:
            raise ValueError(f"block {j + 1} of {num_blocks} is cut short")
        yield block

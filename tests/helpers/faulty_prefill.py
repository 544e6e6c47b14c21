"""`jetllm worker --role prefill` with faults a test asks for through the generate request id
that the prefill job's id starts with:

    corrupt-kv    one byte of the second KV block is flipped on its way out, after the checksums
    slow-prefill  the prefill waits 60 s before reaching the engine (time to kill or cancel it)

    python -m tests.helpers.faulty_prefill worker --role prefill --nats ... --model ...
"""

from __future__ import annotations

import sys

import anyio

from jetllm.kvtransfer import transport
from jetllm.workers.roles import prefill

_current: dict[str, str] = {}


def install() -> None:
    chunks = transport.chunks

    def corrupting(view, block_bytes, num_blocks, chunk, per_message=1):
        at, target = 0, block_bytes + 7  # a byte of the second block, however blocks are chunked
        for piece in chunks(view, block_bytes, num_blocks, chunk, per_message):
            if at <= target < at + len(piece) and "corrupt-kv" in _current.get("rid", ""):
                flipped = bytearray(piece)
                flipped[target - at] ^= 0xFF
                piece = memoryview(bytes(flipped))
            at += len(piece)
            yield piece

    transport.chunks = corrupting
    orig = prefill.PrefillRole._prefill

    async def _prefill(self, req, name):
        _current["rid"] = req.request_id
        if "slow-prefill" in req.request_id:
            await anyio.sleep(60)
        return await orig(self, req, name)

    prefill.PrefillRole._prefill = _prefill


if __name__ == "__main__":
    from jetllm.cli import main

    install()
    sys.exit(main(sys.argv[1:]))

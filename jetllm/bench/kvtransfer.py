"""`jetllm bench-kv`: how fast KV blocks cross NATS, against the physical limit on the same server.

The limit is a plain nats-py publish of the same bytes, cut to the same chunks, to a subscriber in
another process (no JetStream, no checks), paced by the subscriber's receipts as jetllm's is.
jetllm's transfer is what a handoff costs the two workers end to end: the prefill side (this
process) publishes the block file, with the checksums its engine's connector kept, straight to
the decode side or to the block stream; the decode side (kvreceiver.py, in a process of its own
as a decode worker is) checks and writes every block as it arrives, then compares the answer's
checksums and puts its block file in place.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

import anyio
import msgspec
from anyio.abc import Process
from nats.aio.client import Client as NATS

from ..kvtransfer import blockfile
from ..kvtransfer.chunking import blocks_per_message, chunk_size, chunks
from ..kvtransfer.pacing import Pacing
from ..kvtransfer.transport import publish_blocks
from ..kvtransfer.window import WINDOW_BYTES
from ..schemas.disagg import Checksum, KvBlocksHeader, KvLayer, Prefilled
from ..subjects.connection import connect
from ..subjects.names import Names
from ..subjects.setup import ensure_kv_blocks_stream
from .kvreceiver import Received, ReceiveOrder, done_subject, plain_subjects


def make_block_file(
    path: Path, num_blocks: int, block_bytes: int, block_size: int, checksum: str | None = None
) -> KvBlocksHeader:
    """A block file of random blocks, with their checksums kept beside it by `checksum` as the
    prefill engine's connector keeps them (it takes them while it writes the file)."""
    header = KvBlocksHeader(
        block_size=block_size,
        num_tokens=num_blocks * block_size,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        prompt_digest=blockfile.prompt_digest(range(num_blocks * block_size)),
        layers=[KvLayer(name="bench", dtype="uint8", block_shape=[block_bytes], block_dim=0)],
    )
    blockfile.write(path, header, (os.urandom(block_bytes) for _ in range(num_blocks)), checksum)
    return header


class Receiver:
    """The receiving side of both paths in a process of its own (kvreceiver.py), as a decode
    worker is: in this process it would take its CPU from the sending side's event loop."""

    def __init__(self, url: str, names: Names, work: Path) -> None:
        self.url, self.names, self.work = url, names, work
        self.control = f"bench.kvctl.{uuid.uuid4().hex}"
        self.proc: Process | None = None

    async def start(self, nc: NATS) -> None:
        up = await nc.subscribe(f"{self.control}.up", max_msgs=1)
        argv = [sys.executable, "-m", "jetllm.bench.kvreceiver", self.url]
        argv += [self.names.namespace, self.control, str(self.work)]
        self.proc = await anyio.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None
        )
        await up.next_msg(timeout=60)

    async def receive(self, nc: NATS, order: ReceiveOrder) -> Any:
        """Once the receiver listens: the subscription its report comes on."""
        done = await nc.subscribe(done_subject(order.transfer), max_msgs=1)
        await nc.request(self.control, msgspec.msgpack.encode(order), timeout=30)
        return done

    async def stop(self, nc: NATS) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            await nc.publish(self.control, b"")
            await nc.flush()
        with anyio.move_on_after(10):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def _reported(done: Any) -> None:
    msg = await done.next_msg(timeout=120)
    report = msgspec.msgpack.decode(msg.data, type=Received)
    if report.error is not None:
        raise RuntimeError(f"the receiving side failed: {report.error}")


async def plain(nc: NATS, receiver: Receiver, data: memoryview, block_bytes: int, num_blocks: int) -> float:
    """Seconds for the bytes to reach a subscriber through core NATS publishes, paced by the
    subscriber's receipts as jetllm's transfer is: unpaced, a subscriber that falls more than the
    server's max_pending behind is cut off, and the limit would never arrive."""
    transfer = uuid.uuid4().hex
    subject, receipts_to, _ = plain_subjects(transfer)
    chunk = chunk_size(nc.max_payload)
    per_message = blocks_per_message(block_bytes, chunk, packed=True)
    pieces = [bytes(p) for p in chunks(data, block_bytes, num_blocks, chunk, per_message)]
    pacing = Pacing(WINDOW_BYTES)
    pacing.sub = await nc.subscribe(receipts_to, cb=pacing.on_receipt)
    try:
        done = await receiver.receive(nc, ReceiveOrder(path="plain", transfer=transfer, messages=len(pieces)))
        started = time.perf_counter()
        with anyio.fail_after(120):
            for p in pieces:
                if not await pacing.wait():
                    raise RuntimeError("the plain subscriber stopped sending receipts")
                pacing.window.sending(len(p))
                await nc.publish(subject, p)
            await _reported(done)
        return time.perf_counter() - started
    finally:
        await pacing.close()


async def through_jetllm(
    nc: NATS,
    receiver: Receiver,
    src: Path,
    checksum: Checksum,
    window: int = WINDOW_BYTES,
    stored: bool = False,
) -> float:
    """The handoff as the two workers run it: the decode side listens for the blocks and the
    answer, the prefill side publishes the blocks and then the answer, the decode side checks the
    blocks and writes its block file."""
    transfer = uuid.uuid4().hex
    done = await receiver.receive(
        nc, ReceiveOrder(path="jetllm", transfer=transfer, messages=0, stored=stored)
    )
    started = time.perf_counter()
    pub = await publish_blocks(
        nc, receiver.names, transfer, src, packed=True, checksum=checksum, window=window, stored=stored
    )
    answer = Prefilled(
        request_id="bench",
        transfer_id=transfer,
        worker="bench",
        header=pub.header,
        checksums=pub.checksums,
        chunk_bytes=pub.chunk_bytes,
        blocks_per_message=pub.blocks_per_message,
        messages=pub.messages,
        expires_at=time.time() + 600,
    )
    await nc.publish(plain_subjects(transfer)[2], msgspec.msgpack.encode(answer))
    await _reported(done)
    return time.perf_counter() - started


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of this process (the sending side, threads included) and of `pids` (the receiving
    side's, the embedded server's): on a shared machine it tells what a path costs where wall
    time cannot."""
    t = os.times()
    total = t.user + t.system
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


async def _bench(args: argparse.Namespace, url: str, server_pid: int | None = None) -> str:
    work = Path(tempfile.mkdtemp(prefix="jetllm-bench-kv-"))
    names = Names(f"benchkv{uuid.uuid4().hex[:6]}")
    nc = await connect(url, name="bench-kv-sender")
    receiver = Receiver(url, names, work)
    try:
        await ensure_kv_blocks_stream(nc.jetstream(), names, ttl=600, max_bytes=4 * args.mb << 20)
        num_blocks = max(1, (args.mb << 20) // args.block_bytes)
        srcs = {c: work / f"src-{c}.kv" for c in args.checksums}
        for c, src in srcs.items():
            make_block_file(src, num_blocks, args.block_bytes, args.block_size, c)
        header, offset = blockfile.read_header(srcs[args.checksums[0]])
        data = memoryview(srcs[args.checksums[0]].read_bytes())[offset:]
        size = len(data)
        await receiver.start(nc)
        pids = [p for p in (server_pid, receiver.proc.pid if receiver.proc else None) if p is not None]
        paths = ["plain", *(f"{c} {t}" for c in args.checksums for t in args.transfers)]
        rows: dict[str, list[float]] = {p: [] for p in paths}
        cpu: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for path in paths:  # interleaved, so a change in the machine's load hits every path
                before = cpu_seconds(pids)
                if path == "plain":
                    rows[path].append(await plain(nc, receiver, data, args.block_bytes, num_blocks))
                else:
                    name, transfer = path.split()
                    checksum, stored = cast(Checksum, name), transfer == "stored"
                    rows[path].append(await through_jetllm(nc, receiver, srcs[name], checksum, stored=stored))
                cpu[path].append(cpu_seconds(pids) - before)
        for src in srcs.values():
            blockfile.remove(src)
    finally:
        await receiver.stop(nc)
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(names.kv_blocks_stream)
        await nc.close()
        shutil.rmtree(work, ignore_errors=True)
    mbs = {k: size / statistics.median(v) / 1e6 for k, v in rows.items()}
    ms_per_mb = {k: statistics.median(v) * 1000 / (size / 1e6) for k, v in cpu.items()}
    ours = "".join(
        f"| jetllm, {p.split()[0]} checksums, {_TRANSFERS[p.split()[1]]} | {mbs[p]:,.0f} "
        f"| {mbs[p] / mbs['plain']:.0%} | {ms_per_mb[p]:.1f} |\n"
        for p in paths[1:]
    )
    per_token = args.block_bytes / args.block_size
    load = os.getloadavg()[0]
    where = "both sides and the server" if server_pid is not None else "both sides"
    return (
        f"{size / 1e6:,.1f} MB in {num_blocks} blocks of {args.block_bytes:,} bytes "
        f"({per_token:,.0f} bytes per prompt token), median of {args.rounds} rounds, "
        f"1-minute load average {load:.1f} on {os.cpu_count()} CPUs at the end; CPU: {where}:\n\n"
        "| path | MB/s | share of the limit | CPU ms per MB |\n|---|---:|---:|---:|\n"
        f"| plain nats-py publish to a subscriber, paced alike (the limit) | {mbs['plain']:,.0f} | 100% "
        f"| {ms_per_mb['plain']:.1f} |\n{ours}"
    )


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from ..aio import run
    from ..natsserver import NatsServer

    if args.nats:
        text = run(_bench, args, args.nats)
    else:
        with NatsServer(Path(tempfile.mkdtemp(prefix="jetllm-bench-kv-nats-"))) as server:
            text = run(_bench, args, server.url, server.proc.pid if server.proc else None)
    from .run import command_line, publish, section_marks

    text = f"`{command_line('bench-kv')}`\n\n{text}"
    publish(text, None, write=args.write, marks=section_marks("bench-kv"))
    return 0


_TRANSFERS = {
    "direct": "published to the decode side (not stored), every block checked, the file written",
    "stored": "published to the block stream, received as published, every block checked, the file written",
}


def _transfers(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in _TRANSFERS:
            raise argparse.ArgumentTypeError(f"{name!r}: a transfer is one of {', '.join(_TRANSFERS)}")
    return names


def _checksums(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        try:
            blockfile.checksummer(name)
        except blockfile.BadBlockFile as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-kv",
        help="KV blocks through NATS (prefill to decode) against a plain publish of the same bytes",
        description="Time jetllm's KV-block transfer end to end against the physical limit: a plain "
        "nats-py publish of the same bytes, in the same chunks, on the same server.",
    )
    p.add_argument("--mb", type=int, default=256, help="megabytes of blocks per transfer")
    p.add_argument("--block-bytes", type=int, default=65536, help="bytes per block (the tiny model: 65,536)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--checksums",
        type=_checksums,
        default=[blockfile.preferred_checksum()],
        help="comma-separated checksum algorithms to time jetllm's path with, side by side "
        "(sha256-128, blake3-128; default: what a decode worker asks for)",
    )
    p.add_argument(
        "--transfers",
        type=_transfers,
        default=["direct", "stored"],
        help="comma-separated ways to time jetllm's path: direct (the decode worker's default: "
        "--kv-transfer direct), stored (through the block stream)",
    )
    p.add_argument("--nats", default=None, help="use this NATS server instead of an embedded one")
    p.add_argument("--write", default=None, help="replace the bench-kv section of this markdown file")
    p.set_defaults(func=cmd_bench_kv)

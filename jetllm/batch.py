"""Running a JSONL file of prompts as jobs, with results written in input order as they complete.

Memory stays bounded: at most `concurrency` requests are in flight, and a finished result waits
in memory only until every earlier line has finished. A bad line gets an error result and the
batch goes on.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec

from .aio import task_group
from .errors import JetllmError, RequestFailed
from .producer import Client
from .schemas import (
    BatchError,
    BatchLine,
    BatchResult,
    ChatPrompt,
    ErrorCode,
    GenerateRequest,
    OutputOptions,
    Prompt,
    SamplingOptions,
    StopConditions,
    StructuredOutput,
    TextPrompt,
    TokensPrompt,
)
from .subjects.codec import field_path

_line_decoder = msgspec.json.Decoder(BatchLine)


class _LineId(msgspec.Struct):
    id: object = None


_id_decoder = msgspec.json.Decoder(_LineId)


def _salvage_id(raw: bytes) -> str | None:
    try:
        value = _id_decoder.decode(raw).id
    except Exception:
        return None
    return value if isinstance(value, str) else None


_encoder = msgspec.json.Encoder()


class BatchSummary(msgspec.Struct, kw_only=True):
    lines: int = 0
    errors: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def describe(self, out: Path) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (
            f"{self.lines} lines, {self.errors} errors, {self.completion_tokens} tokens generated "
            f"in {self.seconds:.1f}s ({rate:.0f} tokens/s); results in {out}"
        )


def to_request(
    line: BatchLine,
    request_id: str,
    model: str,
    max_tokens: int | None,
    structured: StructuredOutput | None = None,
) -> GenerateRequest:
    """`structured`: the constraint of a line that sets none."""
    forms = [x is not None for x in (line.prompt, line.messages, line.token_ids)]
    if sum(forms) != 1:
        raise RequestFailed(
            ErrorCode.INVALID_REQUEST, "a line needs exactly one of prompt, messages, token_ids"
        )
    prompt: Prompt
    if line.prompt is not None:
        prompt = TextPrompt(line.prompt)
    elif line.messages is not None:
        prompt = ChatPrompt(line.messages)
    else:
        prompt = TokensPrompt(list(line.token_ids or []))
    sampling = line.sampling or SamplingOptions()
    if line.temperature is not None:
        sampling = msgspec.structs.replace(sampling, temperature=line.temperature)
    stop = line.stop or StopConditions()
    if line.max_tokens is not None or (stop.max_tokens is None and max_tokens is not None):
        stop = msgspec.structs.replace(stop, max_tokens=line.max_tokens or max_tokens)
    req = GenerateRequest(
        request_id=request_id,
        model=line.model or model,
        prompt=prompt,
        sampling=sampling,
        stop=stop,
        output=line.output or OutputOptions(),
        structured=line.structured or structured,
    )
    # Re-validate: constraints in Annotated types are only checked on decode.
    return msgspec.convert(msgspec.to_builtins(req), GenerateRequest)


def _read(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


class _Progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled = enabled
        self.total = total
        self.started = time.monotonic()
        self.last = 0.0

    def show(self, done: int, errors: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.2):
            return
        self.last = now
        width = 30
        filled = int(width * done / self.total) if self.total else width
        rate = tokens / max(now - self.started, 1e-9)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} lines, "
            f"{errors} errors, {rate:.0f} tok/s"
        )
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run_batch(
    url: str,
    namespace: str,
    path: Path,
    out: Path,
    *,
    model: str,
    batch_id: str,
    concurrency: int = 64,
    max_tokens: int | None = None,
    structured: StructuredOutput | None = None,
    progress: bool = False,
    heartbeat_timeout: float = 30.0,
) -> BatchSummary:
    total = sum(1 for _ in _read(path))
    summary = BatchSummary()
    bar = _Progress(progress, total)
    started = time.monotonic()
    pending: dict[int, BatchResult] = {}
    order = [n for n, _ in _read(path)]
    next_index = 0
    limiter = anyio.Semaphore(max(1, concurrency))

    async with Client(url, namespace=namespace, heartbeat_timeout=heartbeat_timeout) as client:
        tmp = out.with_name(out.name + ".partial")
        with open(tmp, "wb") as sink:

            def flush_ready() -> None:
                nonlocal next_index
                while next_index < len(order) and order[next_index] in pending:
                    sink.write(_encoder.encode(pending.pop(order[next_index])) + b"\n")
                    next_index += 1
                sink.flush()

            async def one(n: int, raw: bytes) -> None:
                try:
                    rid = f"batch-{batch_id}-{n}"
                    line_id = None
                    try:
                        line = _line_decoder.decode(raw)
                        line_id = line.id
                        req = to_request(line, rid, model, max_tokens, structured)
                        done = await client.complete(req)
                        result = BatchResult(
                            line=n,
                            id=line_id,
                            request_id=rid,
                            text=done.text,
                            token_ids=done.token_ids,
                            finish_reason=done.finish_reason,
                            usage=done.usage,
                        )
                        summary.completion_tokens += done.usage.completion_tokens
                    except msgspec.ValidationError as exc:
                        line_id = line_id or _salvage_id(raw)
                        result = _error(
                            n, line_id, rid, ErrorCode.INVALID_REQUEST, str(exc), field_path(str(exc))
                        )
                    except msgspec.DecodeError as exc:
                        result = _error(n, line_id, rid, ErrorCode.MALFORMED, f"line is not JSON: {exc}")
                    except JetllmError as exc:
                        message = getattr(exc, "remote_message", exc.message)
                        result = _error(n, line_id, rid, exc.code, message, exc.field)
                    if result.error is not None:
                        summary.errors += 1
                    pending[n] = result
                    summary.lines += 1
                    flush_ready()
                    bar.show(summary.lines, summary.errors, summary.completion_tokens)
                finally:
                    limiter.release()

            async with task_group() as tg:
                for n, raw in _read(path):
                    await limiter.acquire()
                    tg.start_soon(one, n, raw)
            flush_ready()
        tmp.replace(out)
    summary.seconds = time.monotonic() - started
    bar.show(summary.lines, summary.errors, summary.completion_tokens, final=True)
    return summary


def _error(
    n: int, line_id: str | None, rid: str, code: ErrorCode, message: str, field: str | None = None
) -> BatchResult:
    if isinstance(code, str) and not isinstance(code, ErrorCode):
        code = ErrorCode(code)
    return BatchResult(
        line=n, id=line_id, request_id=rid, error=BatchError(code=code, message=message, field=field)
    )

"""Files and batches of one namespace, kept in NATS: what the HTTP endpoints and the CLI call.

Nothing here is held in the process: a file is an object in `<NS>_FILES`, a batch's state an
entry of `<NS>_BATCHES`, a batch to run a message on the batch queue. Any gateway replica (or
`jetllm batch`) answers for any file or batch.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable

import anyio
import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from ..errors import JetllmError
from ..openai.endpoints import ENDPOINTS
from ..schemas import TERMINAL_STATUSES, BatchIssue, BatchRun, BatchState, ErrorCode, FileMeta
from ..subjects import codec
from ..subjects.kvsnapshot import entries_matching
from ..subjects.names import Names
from ..subjects.policy import DEFAULTS
from ..subjects.setup import ensure_batch_plane
from . import plan
from .lines import BadInput, InputLine, parse_input

log = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 100 << 20
"""Largest upload, 100 MiB: a batch input is read whole by the runner that takes it."""

PURPOSES = ("batch", "batch_output")


class ApiError(JetllmError):
    """An answer the API gives instead of a result: `status` is the HTTP status, `param` the field
    in OpenAI's terms (`field` too)."""

    code = ErrorCode.INVALID_REQUEST
    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, field=param)
        self.param = param


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    status = 409


class TooLarge(ApiError):
    status = 413


class Unavailable(ApiError):
    code = ErrorCode.INTERNAL
    status = 503
    kind = "server_error"


QUEUE_ATTEMPTS = 5
"""Publishes of a new batch's queue message before the batch is marked failed."""
QUEUE_BACKOFF = 0.2
"""Seconds before the second publish; each later one waits that much longer."""


_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""Every batch and file id this service makes has this shape: an id from a URL or a body that
has not is unknown without asking NATS, and is named in the answer only in part."""

_meta_decoder = msgspec.json.Decoder(FileMeta)


def _known_shape(value: str, kind: str, param: str) -> str:
    if not _ID.fullmatch(value):
        shown = value if len(value) <= 64 else f"{value[:64]}... ({len(value)} characters)"
        raise NotFound(f"no {kind} with id {shown!r}", param=param)
    return value


_state_decoder = msgspec.json.Decoder(BatchState)


class FileInfo(msgspec.Struct, frozen=True):
    id: str
    meta: FileMeta


def file_object(f: FileInfo) -> dict:
    """OpenAI's File object."""
    m = f.meta
    return {
        "id": f.id,
        "object": "file",
        "bytes": m.bytes,
        "created_at": m.created_at,
        "filename": m.filename,
        "purpose": m.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(state: BatchState) -> dict:
    """OpenAI's Batch object."""
    out = msgspec.to_builtins(state)
    out.pop("v", None)
    out.pop("runner", None)
    out["object"] = "batch"
    issues = out.pop("errors", [])
    out["errors"] = {"object": "list", "data": issues} if issues else None
    return out


class BatchService:
    def __init__(
        self, js: JetStreamContext, names: Names, files: ObjectStore, states: KeyValue, **kw: int
    ) -> None:
        self.js = js
        self.names = names
        self.files = files
        self.states = states
        self.max_file_bytes = kw.get("max_file_bytes", DEFAULT_MAX_FILE_BYTES)

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        names: Names,
        *,
        ack_wait: float | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        replicas: int | None = None,
    ) -> BatchService:
        """`ack_wait`: the runners' (`--batch-ack-wait`), set on their consumer when given; None
        leaves an existing consumer's as it is (a producer, `jetllm batch --detach`)."""
        files, states = await ensure_batch_plane(js, names, ack_wait=ack_wait, replicas=replicas)
        return cls(js, names, files, states, max_file_bytes=max_file_bytes)

    # files

    async def upload(self, data: bytes, filename: str, purpose: str, file_id: str | None = None) -> FileInfo:
        if purpose not in PURPOSES:
            raise ApiError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose")
        if len(data) > self.max_file_bytes:
            raise TooLarge(
                f"file is {len(data)} bytes; this server takes at most {self.max_file_bytes} "
                "(--max-file-bytes): split the batch into several files",
                param="file",
            )
        return await self._put(file_id or f"file-{uuid.uuid4().hex[:24]}", data, filename, purpose)

    async def write_output(self, file_id: str, filename: str, data: bytes) -> FileInfo:
        """A batch's output or error file, written by its runner: any size (--max-file-bytes bounds
        what clients send, not what a batch answers)."""
        return await self._put(file_id, data, filename, "batch_output")

    async def _put(self, fid: str, data: bytes, filename: str, purpose: str) -> FileInfo:
        meta = FileMeta(filename=filename, purpose=purpose, created_at=int(time.time()), bytes=len(data))
        await self.files.put(
            fid, data, meta=ObjectMeta(name=fid, description=msgspec.json.encode(meta).decode())
        )
        return FileInfo(fid, meta)

    async def file(self, file_id: str, param: str = "file_id") -> FileInfo:
        _known_shape(file_id, "file", param)
        try:
            info = await self.files.get_info(file_id)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.NotFoundError):
            raise NotFound(f"no file with id {file_id!r}", param=param) from None
        meta = _meta(info.description, info.size or 0)
        if info.size is not None and meta.bytes != info.size:  # the description is only what a writer said
            meta = msgspec.structs.replace(meta, bytes=info.size)
        return FileInfo(file_id, meta)

    async def content(self, file_id: str) -> bytes:
        _known_shape(file_id, "file", "file_id")
        try:
            got = await self.files.get(file_id)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.NotFoundError):
            raise NotFound(f"no file with id {file_id!r}", param="file_id") from None
        return bytes(got.data or b"")

    async def input_lines(self, file_id: str, endpoint: str, *, bounded: bool = True) -> list[InputLine]:
        """A batch's input, checked (raises BadInput naming the line): its size before it is read,
        as the files store may hold objects that did not come through `upload`, and its lines in
        a thread, as checking 100 MiB of JSON takes seconds. `bounded=False`: the input of a batch
        that was created, checked then against the creating side's --max-file-bytes (a runner
        has no such flag of its own to disagree with the gateway's)."""
        info = await self.file(file_id, param="input_file_id")
        if bounded and info.meta.bytes > self.max_file_bytes:
            raise TooLarge(
                f"input file {file_id} is {info.meta.bytes} bytes; a batch input is at most "
                f"{self.max_file_bytes} (--max-file-bytes): split it into several files",
                param="input_file_id",
            )
        data = await self.content(file_id)
        return await anyio.to_thread.run_sync(parse_input, data, endpoint)

    async def list_files(self, purpose: str | None = None) -> list[FileInfo]:
        """Newest first."""
        try:
            infos = await self.files.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        out = [FileInfo(i.name, _meta(i.description, i.size or 0)) for i in infos if not i.deleted]
        out = [f for f in out if purpose is None or f.meta.purpose == purpose]
        return sorted(out, key=lambda f: (f.meta.created_at, f.id), reverse=True)

    async def delete_file(self, file_id: str) -> None:
        """Refused (409) while a batch that has not ended reads the file: its runner, or the one
        taking it over, needs the input to write the output. A batch created between the check
        and the delete finds the file gone and fails saying so (held.py)."""
        await self.file(file_id)
        user = await self._batch_reading(file_id)
        if user is not None:
            raise Conflict(
                f"file {file_id} is the input of batch {user.id}, which is {user.status}: delete the file "
                f"once the batch has ended, or cancel it first (POST /v1/batches/{user.id}/cancel)",
                param="file_id",
            )
        await self.files.delete(file_id)

    async def _batch_reading(self, file_id: str) -> BatchState | None:
        for state in await self._states():
            if state.input_file_id == file_id and state.status not in TERMINAL_STATUSES:
                return state
        return None

    # batches

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> BatchState:
        """Checks the whole input file, stores the batch and queues it for a runner."""
        if endpoint not in ENDPOINTS:
            raise ApiError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint"
            )
        if not isinstance(completion_window, str):
            raise ApiError("completion_window must be a string such as '24h'", param="completion_window")
        try:
            window = plan.parse_window(completion_window)
        except ValueError as exc:
            raise ApiError(str(exc), param="completion_window") from None
        _check_window_kept(completion_window, window, await self.kept_for())
        _check_metadata(metadata)
        f = await self.file(input_file_id, param="input_file_id")
        if f.meta.purpose != "batch":
            raise ApiError(
                f"file {input_file_id} has purpose {f.meta.purpose!r}, not 'batch'", param="input_file_id"
            )
        try:
            lines = await self.input_lines(input_file_id, endpoint)
        except BadInput as exc:
            raise ApiError(
                f"input file {input_file_id}: {exc.message}", param=exc.param or "input_file_id"
            ) from None
        now = int(time.time())
        state = BatchState(
            id=f"batch_{uuid.uuid4().hex}",
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window,
            metadata=metadata,
        )
        state.request_counts.total = len(lines)
        await self.states.create(self.names.batch_key(state.id), msgspec.json.encode(state))
        await self._queue(state.id)
        return state

    async def _queue(self, batch_id: str) -> None:
        """Hand the batch to the runners, retried (Nats-Msg-Id drops a copy that did arrive). A
        batch that cannot be queued is marked failed: left `validating`, no runner would ever
        take it."""
        for attempt in range(QUEUE_ATTEMPTS):
            try:
                await self._publish_run(batch_id)
                return
            except Exception as exc:  # NATS away for now, a stream leader moving: try again
                error = exc
                await anyio.sleep(QUEUE_BACKOFF * (attempt + 1))
        message = (
            f"batch {batch_id} could not be handed to the batch runners ({type(error).__name__}: {error}); "
            "it is marked failed: create it again"
        )
        now = int(time.time())
        issue = BatchIssue(code="queue_unavailable", message=message)
        await self.update(
            batch_id, lambda s: msgspec.structs.replace(s, status="failed", failed_at=now, errors=[issue])
        )
        raise Unavailable(message)

    async def _publish_run(self, batch_id: str) -> None:
        await self.js.publish(
            self.names.batch_queue(batch_id),
            codec.encode(BatchRun(batch_id=batch_id)),
            headers={"Nats-Msg-Id": batch_id},
        )

    async def kept_for(self) -> float:
        """Seconds this namespace keeps a queued job and a result, the shorter: a batch running
        longer would find lines it ran rerun (their results gone) and jobs it queued dropped.
        As the streams have it; the defaults for a namespace whose streams no worker made yet."""
        kept = []
        for stream, setting in (
            (self.names.jobs_stream, "max_age"),
            (self.names.requests_stream, "results_max_age"),
        ):
            try:
                info = await self.js.stream_info(stream)
                age = float(info.config.max_age or 0) or float("inf")  # 0: kept for ever
            except Exception:  # not made yet, or not ours to read: what a new namespace gets
                age = float(DEFAULTS[setting])
            kept.append(age)
        return min(kept)

    async def get(self, batch_id: str) -> BatchState:
        return (await self._entry(batch_id))[0]

    async def _entry(self, batch_id: str) -> tuple[BatchState, int]:
        _known_shape(batch_id, "batch", "batch_id")
        try:
            entry = await self.states.get(self.names.batch_key(batch_id))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError, ValueError):
            raise NotFound(f"no batch with id {batch_id!r}", param="batch_id") from None
        try:
            return _state_decoder.decode(entry.value or b""), entry.revision or 0
        except msgspec.DecodeError as exc:  # written by something else: nothing to run or show
            raise NotFound(f"batch {batch_id!r} has an unreadable state ({exc})", param="batch_id") from None

    async def _states(self) -> list[BatchState]:
        states = []
        for entry in await entries_matching(self.states, ">"):
            try:
                states.append(_state_decoder.decode(entry.value or b""))
            except msgspec.DecodeError:
                continue
        return states

    async def list(self, after: str | None = None, limit: int = 20) -> tuple[list[BatchState], bool]:
        """A page of batches, newest first, starting after the batch `after`; and whether more follow."""
        states = await self._states()
        states.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        return plan.page(states, after, limit, key=lambda s: s.id)

    async def update(self, batch_id: str, change: Callable[[BatchState], BatchState | None]) -> BatchState:
        """Apply `change` by compare-and-set, again on the newest state when someone wrote between;
        `change` returning None leaves the state as it is."""
        while True:
            state, revision = await self._entry(batch_id)
            new = change(state)
            if new is None:
                return state
            try:
                await self.states.update(
                    self.names.batch_key(batch_id), msgspec.json.encode(new), last=revision
                )
                return new
            except nats.js.errors.KeyWrongLastSequenceError:
                continue

    async def cancel(self, batch_id: str) -> BatchState:
        """Marks the batch cancelling; its runner stops it (a batch no runner holds yet is
        cancelled by the first runner that takes it)."""
        now = int(time.time())

        def change(state: BatchState) -> BatchState | None:
            if state.status in ("cancelling", "cancelled"):
                return None
            if state.status in TERMINAL_STATUSES or state.status == "finalizing":
                raise Conflict(
                    f"batch {batch_id} is {state.status}; only a validating or in_progress batch can be "
                    "cancelled",
                    param="batch_id",
                )
            was.append(state.status)
            return msgspec.structs.replace(state, status="cancelling", cancelling_at=now)

        was: list[str] = []
        cancelling = await self.update(batch_id, change)
        if was and was[-1] == "validating":
            # Perhaps never queued (its gateway died before): a runner must take it to end it. The
            # Nats-Msg-Id drops this copy when the first is still queued.
            try:
                await self._publish_run(batch_id)
            except Exception as exc:  # the first copy may be queued anyway
                log.warning("batch %s: could not queue it again to be cancelled: %s", batch_id, exc)
        return cancelling


MAX_METADATA = (16, 64, 512)
"""OpenAI's limits on a batch's metadata: pairs, characters of a key, characters of a value. Every
read of a batch (and each listing) carries it."""


def _check_metadata(metadata: object) -> None:
    pairs, key_chars, value_chars = MAX_METADATA
    if metadata is None:
        return
    if not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise ApiError("metadata must map strings to strings", param="metadata")
    if (
        len(metadata) > pairs
        or any(len(k) > key_chars for k in metadata)
        or any(len(v) > value_chars for v in metadata.values())
    ):
        raise ApiError(
            f"metadata takes at most {pairs} pairs, keys of at most {key_chars} characters and values of "
            f"at most {value_chars}",
            param="metadata",
        )


def _check_window_kept(text: str, window: int, kept: float) -> None:
    if window > kept:
        whole = int(kept)
        hours = next(f"{whole // n}{u}" for n, u in ((3600, "h"), (60, "m"), (1, "s")) if whole % n == 0)
        raise ApiError(
            f"completion_window {text} is longer than this namespace keeps queued jobs and results "
            f"({hours}): a batch running longer would rerun lines whose results expired. Give at most "
            f"{hours}, or start the workers with a larger --max-age (seconds)",
            param="completion_window",
        )


def _meta(description: str | None, size: int) -> FileMeta:
    try:
        return _meta_decoder.decode(description or "")
    except msgspec.DecodeError:  # an object someone put there by other means
        return FileMeta(filename="", purpose="", created_at=0, bytes=size)

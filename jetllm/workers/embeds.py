"""Embeddings prompts: every field of the tensor checked before the engine sees it.

A tensor of the wrong width does not fail one request inside vLLM, it kills the engine; and the
bytes come from whoever can publish a job. So the tensor is rebuilt here from raw bytes with
numpy (never unpickled), its shape, size and values are checked against the model, and an
object-store reference is looked up (size, no links, digest) before anything is downloaded.
"""

from __future__ import annotations

import hashlib
from typing import Any

import anyio
import nats.js.errors
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from ..errors import RequestRejected
from ..schemas import EmbedsPrompt, ErrorCode
from ..subjects.names import Names
from .engine import EngineFacts, PromptEmbeds
from .requestlog import LogUnavailable

HARD_CAP = 1 << 30
"""No embeddings prompt is ever bigger than this (1 GiB), whatever the worker's settings say."""

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_NUMPY = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


class StoreUnavailable(LogUnavailable):
    """The object store did not answer: the job waits and is tried again, like a log outage."""


def default_max_bytes(facts: EngineFacts) -> int:
    """The largest tensor a request can use: a full context of float32 rows, capped."""
    return min(HARD_CAP, facts.max_model_len * (facts.hidden_size or 0) * 4)


def _reject(message: str, field: str) -> RequestRejected:
    return RequestRejected(ErrorCode.INVALID_REQUEST, message, field=field)


def check_header(prompt: EmbedsPrompt, facts: EngineFacts, max_bytes: int) -> int:
    """Checks everything but the bytes themselves; returns how many bytes the tensor must have."""
    if not facts.prompt_embeds or not facts.hidden_size:
        raise _reject(
            f"the workers of {facts.model!r} do not accept prompt embeddings "
            "(they run without --enable-prompt-embeds)",
            "$.prompt",
        )
    if (prompt.data is None) == (prompt.object is None):
        raise _reject("an embeddings prompt needs exactly one of `data` and `object`", "$.prompt.data")
    if prompt.object is not None and prompt.sha256 is None:
        raise _reject("an embeddings prompt in the object store needs its `sha256`", "$.prompt.sha256")
    if len(prompt.shape) != 2:
        raise _reject(
            f"prompt embeddings must be 2-D [rows, hidden]; got shape {list(prompt.shape)} "
            f"({len(prompt.shape)}-D)",
            "$.prompt.shape",
        )
    rows, hidden = prompt.shape
    if rows < 1:
        raise _reject("prompt embeddings need at least one row", "$.prompt.shape")
    if hidden != facts.hidden_size:
        raise _reject(
            f"prompt embeddings have hidden size {hidden}, but {facts.model!r} has hidden size "
            f"{facts.hidden_size}",
            "$.prompt.shape",
        )
    if rows >= facts.max_model_len:
        raise RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt has {rows} embedding rows, but this model's maximum context length is "
            f"{facts.max_model_len} tokens (prompt plus at least one generated token)",
            field="$.prompt.shape",
        )
    nbytes = rows * hidden * ITEMSIZE[prompt.dtype]
    if nbytes > max_bytes:
        raise _reject(
            f"prompt embeddings of shape {[rows, hidden]} ({prompt.dtype}) take {nbytes} bytes; this worker "
            f"accepts at most {max_bytes} bytes (--max-embeds-bytes)",
            "$.prompt.shape",
        )
    if prompt.data is not None and len(prompt.data) != nbytes:
        raise _reject(
            f"`data` has {len(prompt.data)} bytes, but shape {[rows, hidden]} of {prompt.dtype} needs "
            f"{nbytes} (rows * hidden * {ITEMSIZE[prompt.dtype]})",
            "$.prompt.data",
        )
    return nbytes


def to_array(data: bytes, dtype: str, shape: list[int]) -> Any:
    """The tensor as a writable numpy array (bfloat16 as uint16 bits); rejects NaN and infinity."""
    import numpy as np

    array = np.frombuffer(data, dtype=np.dtype(_NUMPY[dtype])).reshape(shape)
    if dtype == "bfloat16":
        finite = not bool(((array & 0x7F80) == 0x7F80).any())  # exponent all ones: inf or NaN
    else:
        finite = bool(np.isfinite(array).all())
    if not finite:
        raise _reject("prompt embeddings contain NaN or infinite values", "$.prompt.data")
    return array.astype(array.dtype.newbyteorder("="), copy=True)


class EmbedsLoader:
    """Turns an EmbedsPrompt of a job into the engine's PromptEmbeds (raises RequestRejected)."""

    def __init__(self, js: Any, names: Names, facts: EngineFacts, max_bytes: int | None = None) -> None:
        self.js = js
        self.names = names
        self.facts = facts
        limit = default_max_bytes(facts) if max_bytes is None else max_bytes
        self.max_bytes = min(limit, HARD_CAP)

    async def load(self, prompt: EmbedsPrompt) -> PromptEmbeds:
        nbytes = check_header(prompt, self.facts, self.max_bytes)
        data = prompt.data if prompt.data is not None else await self._fetch(prompt, nbytes)
        if nbytes > (1 << 20):
            array = await anyio.to_thread.run_sync(to_array, data, prompt.dtype, prompt.shape)
        else:
            array = to_array(data, prompt.dtype, prompt.shape)
        return PromptEmbeds(array, prompt.dtype)

    async def _fetch(self, prompt: EmbedsPrompt, nbytes: int) -> bytes:
        name = prompt.object
        assert name is not None and prompt.sha256 is not None
        store_name = self.names.embeds_store
        try:
            store = await self.js.object_store(store_name)
            info = await store.get_info(name)
        except (
            nats.js.errors.NotFoundError,
            nats.js.errors.ObjectDeletedError,
            nats.js.errors.InvalidObjectNameError,
        ):
            raise _reject(
                f"no object {name!r} in the embeddings store {store_name}", "$.prompt.object"
            ) from None
        except nats.js.errors.BadObjectMetaError:
            raise _reject(f"object {name!r} has unreadable metadata", "$.prompt.object") from None
        except Exception as exc:
            raise StoreUnavailable(f"embeddings store {store_name}: {type(exc).__name__}: {exc}") from None
        if info.is_link():
            raise _reject(
                f"object {name!r} is a link; embeddings must be stored as plain objects", "$.prompt.object"
            )
        if info.size != nbytes:
            raise _reject(
                f"object {name!r} has {info.size} bytes, but shape {list(prompt.shape)} of {prompt.dtype} "
                f"needs {nbytes}",
                "$.prompt.object",
            )
        if not isinstance(info.nuid, str) or not info.nuid:
            raise _reject(f"object {name!r} has unreadable metadata (no chunk id)", "$.prompt.object")
        data = await self._read_chunks(name, info.nuid, nbytes)
        digest = await anyio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest())
        if digest != prompt.sha256:
            raise _reject(
                f"object {name!r} does not match the request's sha256 (it holds {digest})", "$.prompt.sha256"
            )
        return data

    async def _read_chunks(self, name: str, nuid: str, nbytes: int) -> bytes:
        """The object's bytes, one chunk per request and never more than `nbytes`.

        Not nats-py's `ObjectStore.get`: anyone can write an object's metadata, and for metadata that
        names chunks the store does not hold, that waits forever (the job would hold its slot for
        good); for chunks of a bigger object, it reads all of them into memory.
        """
        bucket = self.names.embeds_store
        stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
        subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
        parts: list[bytes] = []
        got, seq = 0, 1
        while got < nbytes:
            try:
                chunk = await self.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                missing = f"object {name!r} holds {got} of its {nbytes} bytes"
                raise _reject(missing, "$.prompt.object") from None
            except Exception as exc:
                raise StoreUnavailable(f"embeddings store {bucket}: {type(exc).__name__}: {exc}") from None
            parts.append(chunk.data or b"")
            got += len(parts[-1])
            seq = (chunk.seq or seq) + 1
        if got != nbytes:
            raise _reject(f"object {name!r} holds more than its {nbytes} bytes", "$.prompt.object")
        return b"".join(parts)

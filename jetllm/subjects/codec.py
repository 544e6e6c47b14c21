"""Bytes on the wire: msgpack by default, JSON when the `Content-Type` header says so."""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from ..schemas import Frame, GenerateRequest, PrefillRequest

Encoding = Literal["msgpack", "json"]
CONTENT_TYPE = "Content-Type"
MSGPACK = "application/msgpack"
JSON = "application/json"
_BY_TYPE: dict[str, Encoding] = {
    MSGPACK: "msgpack",
    "application/x-msgpack": "msgpack",
    "application/vnd.msgpack": "msgpack",
    JSON: "json",
    "text/json": "json",
}

FRAME_BATCH_HEADER = "Jetllm-Frame-Batch"
SHARD_REQUESTS_HEADER = "Jetllm-Requests"
"""On a shard job: how many requests it carries, so a worker holds their slots the moment it
arrives (before its puller could take another shard into them). Not trusted: corrected once decoded."""
"""On a job: the producer reads this job's frames batched with others' on the subject named
(see workers/framebatch.py). A header, not a field: a worker that does not know it sends frames singly."""

HEADER_MARGIN = 512
"""Bytes kept free under max_payload for headers (nats-py only checks the body)."""


class UnknownContentType(ValueError):
    pass


def encoding_of(headers: dict[str, str] | None) -> Encoding:
    """The encoding a message declares; no header means msgpack."""
    if not headers:
        return "msgpack"
    value = next((v for k, v in headers.items() if k.lower() == "content-type"), None)
    if value is None:
        return "msgpack"
    kind = value.split(";")[0].strip().lower()
    try:
        return _BY_TYPE[kind]
    except KeyError:
        raise UnknownContentType(
            f"unsupported Content-Type {value[:64]!r}; use {MSGPACK} or {JSON}"
        ) from None


def content_type(encoding: Encoding) -> str:
    return JSON if encoding == "json" else MSGPACK


_mp_enc = msgspec.msgpack.Encoder()
_js_enc = msgspec.json.Encoder()


def encode(obj: Any, encoding: Encoding = "msgpack") -> bytes:
    return _js_enc.encode(obj) if encoding == "json" else _mp_enc.encode(obj)


class Decoder:
    """Decoders for one type in both encodings, reused (building them is the slow part)."""

    def __init__(self, type_: Any) -> None:
        self._mp = msgspec.msgpack.Decoder(type_)
        self._js = msgspec.json.Decoder(type_)

    def decode(self, data: bytes, encoding: Encoding = "msgpack") -> Any:
        """The message, or msgspec.DecodeError / ValidationError naming what is wrong.

        msgspec reports invalid UTF-8 as UnicodeDecodeError and very deep nesting as
        RecursionError; both are bad input like any other and become a DecodeError here, so a
        caller that handles msgspec's errors handles every malformed message.
        """
        try:
            return self._js.decode(data) if encoding == "json" else self._mp.decode(data)
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(f"invalid UTF-8 at byte {exc.start}") from None
        except RecursionError:
            raise msgspec.DecodeError("nested too deeply") from None


class UnknownKind(msgspec.ValidationError):
    """A message of a kind this version does not know, from a newer writer: readers skip it.

    A ValidationError, so code that does not care still treats it as undecodable."""

    def __init__(self, tag_field: str, kind: str) -> None:
        super().__init__(f"unknown {tag_field} {kind[:64]!r} (from a newer version?)")
        self.kind = kind


class KindDecoder(Decoder):
    """Decoder for a tagged union newer writers may extend (frames, request-log records).

    A message whose tag names no member raises UnknownKind; any other failure raises as usual.
    The tag is looked at only after decoding failed, so known messages cost nothing extra.
    """

    def __init__(self, union: Any) -> None:
        super().__init__(union)
        members = union.__args__
        self.tag_field: str = members[0].__struct_config__.tag_field
        self.kinds = frozenset(m.__struct_config__.tag for m in members)
        head = msgspec.defstruct("Head", [(self.tag_field, Any, None)])
        self._head = Decoder(head)

    def decode(self, data: bytes, encoding: Encoding = "msgpack") -> Any:
        try:
            return super().decode(data, encoding)
        except msgspec.ValidationError:
            try:
                kind = getattr(self._head.decode(data, encoding), self.tag_field)
            except msgspec.DecodeError:
                kind = None
            if isinstance(kind, str) and kind not in self.kinds:
                raise UnknownKind(self.tag_field, kind) from None
            raise


class JobEnvelope(msgspec.Struct, kw_only=True):
    """The few fields read from a job that fails to decode, to say why and to whom."""

    v: Any = None
    request_id: Any = None
    reply_to: Any = None


frame_decoder = KindDecoder(Frame)


class _Named(msgspec.Struct):
    request_id: Any = None


class ShardEnvelope(msgspec.Struct):
    """The request ids read from a shard that cannot be decoded, to fail each by name."""

    requests: list[_Named] = []


def shard_request_ids(data: bytes, encoding: Encoding, most: int) -> list[str]:
    """The request ids a shard's bytes name (each once, at most `most`), as far as they can be read."""
    try:
        named = shard_envelope_decoder.decode(data, encoding).requests
    except Exception:
        return []
    ids = {e.request_id for e in named if isinstance(e.request_id, str) and 0 < len(e.request_id) <= 200}
    return sorted(ids)[:most]


request_decoder = Decoder(GenerateRequest)
prefill_decoder = Decoder(PrefillRequest)
envelope_decoder = Decoder(JobEnvelope)
shard_envelope_decoder = Decoder(ShardEnvelope)


_AT = re.compile(r" - at `(\$[^`]*)`$")
_NAMED = re.compile(r"(?:missing required|contains unknown) field `([^`]+)`")


def field_path(message: str) -> str | None:
    """The field a msgspec validation message is about, as `$.a.b`."""
    at = _AT.search(message)
    path = at.group(1) if at else "$"
    named = _NAMED.search(message)
    if named:
        return f"{path}.{named.group(1)}"
    return path if at else None

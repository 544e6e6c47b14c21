"""Control verbs of one worker: request/reply on its instance subject and on its model's subject.

Each verb declares the type of its request; the server decodes the body with it (an empty body is
`{}`: the type's defaults, or an error naming the first required field) and the handler gets the
decoded Struct, or None for a verb that takes no body (its body must be empty, `{}` or `{"v": 1}`).
Requests are strict like jobs: an unknown field or a schema version this worker does not speak
is refused, naming the field. A handler returns a reply Struct or raises ControlError; the reply
(or a ControlFailed naming this instance) goes back to the asker, so a fan-out over the model
subject collects one answer per instance. Handlers run in their own task, never in the NATS callback.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..aio import TaskGroup, owned_cancellation
from ..errors import JetllmError
from ..schemas import ControlFailed, ErrorCode
from ..schemas.common import SUPPORTED_VERSIONS, Command
from ..subjects import codec
from ..subjects.names import Names

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[msgspec.Struct]]
"""(decoded request, or None for a verb without one) -> reply."""
RequestType = type[msgspec.Struct] | None
"""What a verb's body decodes as; None: the verb takes no body."""


class ControlError(JetllmError):
    """A control verb refused or failed; becomes a ControlFailed reply with its code and message."""


def reply_encoding(msg: Msg) -> Any:
    try:
        return codec.encoding_of(msg.headers)
    except codec.UnknownContentType:
        return "msgpack"


class NoBody(Command, kw_only=True):
    """What a verb without a request may be sent: nothing but `v`, so `wake {"force": true}` is
    refused rather than silently ignored."""


@functools.cache
def decoder(request: type[msgspec.Struct]) -> codec.Decoder:
    """The decoder of a verb's request type (strict: an unknown field is refused), built once."""
    return codec.Decoder(request)


def naming_field(exc: Exception) -> str:
    """msgspec's message, led by the field it is about where the message leaves it out (an
    unknown or missing field at the top level is named without its path)."""
    text = str(exc)
    field = codec.field_path(text)
    return f"{field}: {text}" if field and f"`{field}`" not in text else text


def decode_request(request: RequestType, body: bytes, encoding: Any) -> Any:
    """A verb's request from its body (empty: `{}`), with its version checked; None for a verb
    without one."""
    try:
        if not body:
            decoded = msgspec.convert({}, request or NoBody)
        else:
            decoded = decoder(request or NoBody).decode(body, encoding)
    except msgspec.ValidationError:
        _check_version(_salvaged_version(body, encoding))
        raise
    _check_version(getattr(decoded, "v", None))
    return None if request is None else decoded


def _salvaged_version(body: bytes, encoding: Any) -> Any:
    """`v` of a request that failed to decode: a newer version's fields are not this one's errors."""
    try:
        return codec.envelope_decoder.decode(body, encoding).v
    except Exception:
        return None


def _check_version(version: Any) -> None:
    if version is not None and version not in SUPPORTED_VERSIONS:
        raise ControlError(
            f"$.v: schema version {version!r} is not supported (this worker speaks "
            f"{sorted(SUPPORTED_VERSIONS)}); use a jetllm of the same version",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )


class ControlServer:
    def __init__(self, nc: NATS, names: Names, instance: str, model: str) -> None:
        self.nc = nc
        self.names = names
        self.instance = instance
        self.model = model
        self._handlers: dict[str, tuple[Handler, RequestType, bool]] = {}
        self._subs: list[Subscription] = []
        self._tg: TaskGroup | None = None

    def add(
        self, verb: str, handler: Handler, *, request: RequestType = None, model_wide: bool = True
    ) -> None:
        """Serve `verb` on this instance's subject and, if `model_wide`, on the model's subject;
        `handler` gets the body decoded as `request` (None: the verb takes no body)."""
        self._handlers[verb] = (handler, request, model_wide)

    async def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        for verb, (handler, request, model_wide) in self._handlers.items():
            subjects = [self.names.instance_control(self.instance, verb)]
            if model_wide:
                subjects.append(self.names.model_control(self.model, verb))
            for subject in subjects:
                self._subs.append(await self.nc.subscribe(subject, cb=self._callback(verb, handler, request)))
        await self.nc.flush()  # the server knows every subscription before anyone is told we serve

    async def stop(self) -> None:
        """Stop answering (a draining or dead worker must not look available)."""
        self._tg = None
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    def _callback(
        self, verb: str, handler: Handler, request: RequestType
    ) -> Callable[[Msg], Awaitable[None]]:
        async def on_msg(msg: Msg) -> None:
            if self._tg is not None:
                self._tg.start_soon(self._answer, verb, handler, request, msg)

        return on_msg

    async def _answer(self, verb: str, handler: Handler, request: RequestType, msg: Msg) -> None:
        encoding = reply_encoding(msg)
        try:
            with owned_cancellation(f"control verb {verb}"):
                reply: msgspec.Struct = await handler(decode_request(request, msg.data, encoding))
        except ControlError as exc:
            reply = ControlFailed(instance=self.instance, code=exc.code, message=exc.message)
        except (msgspec.ValidationError, msgspec.DecodeError, codec.UnknownContentType) as exc:
            reply = ControlFailed(
                instance=self.instance, code=ErrorCode.INVALID_REQUEST, message=f"{verb}: {naming_field(exc)}"
            )
        except Exception as exc:
            log.exception("control verb %s failed", verb)
            reply = ControlFailed(instance=self.instance, code=ErrorCode.INTERNAL, message=f"{verb}: {exc}")
        if msg.reply:
            try:
                await self.nc.publish(msg.reply, codec.encode(reply, encoding))
            except Exception as exc:
                log.warning("control verb %s: reply not sent: %s", verb, exc)

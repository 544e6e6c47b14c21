"""An adapter may not take the name of a model this fleet serves.

Jobs naming an adapter as their model go to the queue `jobs.<role>.<adapter>`, which is also the
queue of a model by that name: a worker holding the adapter would take that model's jobs and run
them with the adapter. Models are those with a card in the registry now; one started later under
an adapter's name is not caught (docs/decisions.md).
"""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from ...schemas import ErrorCode
from ...subjects.names import Names
from ..control import ControlError

log = logging.getLogger(__name__)


async def refuse_model_name(js: JetStreamContext, names: Names, served: str, name: str) -> None:
    """`served`: the model this worker serves, which may not have a card yet."""
    if name == served or await _model_card_exists(js, names, name):
        raise ControlError(
            f"$.name: adapter {name!r} has the name of a model this fleet serves, so it would "
            "take that model's jobs; load it under another name",
            code=ErrorCode.INVALID_REQUEST,
        )


async def _model_card_exists(js: JetStreamContext, names: Names, model: str) -> bool:
    try:
        kv = await js.key_value(names.registry_bucket)
        entry = await kv.get(names.model_card_key(model))
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
        return False  # KeyNotFoundError and KeyDeletedError are NotFoundErrors
    except nats.errors.Error as exc:  # a registry out of reach must not fail the load for good
        log.warning("adapter %r: the registry's model cards could not be read (%s)", model, exc)
        return False
    return bool(entry.value)

"""What every message shares: the compatibility rule of its direction, the schema version and the
stable error codes.

Every struct on the wire derives from one of two bases, and the base is the rule:

- `Strict`: what a worker is told to do (jobs, cancels, control requests, the adapter specs and
  manifests operators write). A field the reader does not know is an error naming it, so a typo
  (`max_token`) never runs silently with a default.
- `Tolerant`: what workers and services report (frames, replies, records, events, dead letters,
  batch results). A reader skips fields it does not know, so a newer writer can add one without
  breaking older readers mid-stream.

`Command` and `Report` are the same two rules for top-level messages, which carry `v`.
"""

from __future__ import annotations

import enum

import msgspec

SCHEMA_VERSION = 1
"""Major version of the wire contract. Workers refuse messages of any other version."""

SUPPORTED_VERSIONS = frozenset({1})


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    """Part of an instruction to a worker: unknown fields are refused, naming the field."""


class Tolerant(msgspec.Struct):
    """Part of what a worker or service reports: readers skip fields they do not know."""


class Command(Strict, kw_only=True):
    """A message that tells a worker what to do; strict."""

    v: int = SCHEMA_VERSION
    """Schema version; a worker refuses versions it does not speak."""


class Report(Tolerant, kw_only=True):
    """A message a worker or service writes for others to read; tolerant."""

    v: int = SCHEMA_VERSION
    """Schema version of the writer."""


BASES: tuple[type[msgspec.Struct], ...] = (Strict, Tolerant, Command, Report)
"""The rule bases: never on the wire by themselves."""


class ErrorCode(enum.StrEnum):
    """Machine-readable error codes; their values are part of the wire contract.

    A code this version does not know (sent by a newer worker) decodes to a pseudo-member named
    `UNKNOWN` whose value is the code as sent: it equals no known member, `known` is false, and
    `str()`/`.value` and re-encoding give the original string.
    """

    MALFORMED = "malformed"
    """The bytes could not be decoded at all (not msgpack/JSON, or an unknown content type)."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """The message names a schema version this worker does not speak."""
    INVALID_REQUEST = "invalid_request"
    """A field is missing, of the wrong type or out of range; `field` names it."""
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    """Prompt (plus max_tokens) does not fit the model's context; the message names the limit."""
    MODEL_NOT_SERVED = "model_not_served"
    """The worker that pulled the job does not serve the model it names."""
    ENGINE_ERROR = "engine_error"
    """The engine failed this one request; the worker goes on serving."""
    CANCELLED = "cancelled"
    """The request was cancelled before it finished."""
    MIGRATION_BUDGET_EXHAUSTED = "migration_budget_exhausted"
    """Workers died under this request more often than its migration budget allows."""
    NOT_MIGRATABLE = "not_migratable"
    """A worker died after tokens were delivered, and the request cannot continue elsewhere
    without changing them (n > 1); the message says why."""
    DELIVERIES_EXHAUSTED = "deliveries_exhausted"
    """JetStream delivered the job max_deliver times without any worker finishing it."""
    CONFLICT = "conflict"
    """A control verb the instance cannot carry out in its current state (the message says which)."""
    LORA_DISABLED = "lora_disabled"
    """The worker runs without LoRA (`--enable-lora`), so it has no adapters to load or run."""
    UNKNOWN_ADAPTER = "unknown_adapter"
    """The request names an adapter its model does not have (never loaded, or unloaded)."""
    ADAPTER_NOT_LOADED = "adapter_not_loaded"
    """The adapter is wanted for this model, but the worker that pulled the job failed to load it."""
    NO_ADAPTER_SLOT = "no_adapter_slot"
    """The instance already holds as many adapters as it can (`--max-loras`); unload one first."""
    ADAPTER_NOT_ALLOWED = "adapter_not_allowed"
    """The adapter's source is refused: a path outside every `--lora-dir` (or no `--lora-dir`),
    or a hub source on a worker without `--lora-allow-hub`."""
    ADAPTER_NOT_FOUND = "adapter_not_found"
    """The adapter's files are not there (no such directory, object or hub repository)."""
    ADAPTER_INVALID = "adapter_invalid"
    """The adapter's files fail validation (config, rank, shapes, size, hash); the engine never saw them."""
    EXPIRED = "expired"
    """A prefill job taken after its `expires_at`: its decode worker no longer waits for it."""
    KV_TRANSFER_FAILED = "kv_transfer_failed"
    """The prefill worker computed the blocks but could not hand them on (the block store is full
    or unreachable); its decode worker computes the prompt itself."""
    INTERNAL = "internal"
    """A bug in jetllm; the message says where."""
    WORKER_SILENT = "worker_silent"
    """Producer side: no frame arrived within the heartbeat timeout."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """Producer side: the encoded job exceeds the server's max_payload."""
    TIMEOUT = "timeout"
    """Producer side: no worker accepted the job within the accept timeout."""

    @classmethod
    def _missing_(cls, value: object) -> ErrorCode | None:
        if not isinstance(value, str):
            return None
        member = str.__new__(cls, value)
        member._name_ = "UNKNOWN"
        member._value_ = value
        return member

    @property
    def known(self) -> bool:
        """Whether this version defines the code (false for codes of newer writers)."""
        return self._value_ in type(self)._value2member_map_

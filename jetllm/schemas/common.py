"""What every message shares: the schema version and the stable error codes."""

from __future__ import annotations

import enum

import msgspec

SCHEMA_VERSION = 1
"""Major version of the wire contract. Workers refuse messages of any other version."""

SUPPORTED_VERSIONS = frozenset({1})


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every wire message.

    Unknown fields are refused so that a typo (`max_token`) is an error, not a silent default.
    """

    v: int = SCHEMA_VERSION
    """Schema version; a worker refuses versions it does not speak."""


class ErrorCode(enum.StrEnum):
    """Machine-readable error codes; their values are part of the wire contract."""

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
    INTERNAL = "internal"
    """A bug in jetllm; the message says where."""
    WORKER_SILENT = "worker_silent"
    """Producer side: no frame arrived within the heartbeat timeout."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """Producer side: the encoded job exceeds the server's max_payload."""
    TIMEOUT = "timeout"
    """Producer side: no worker accepted the job within the accept timeout."""

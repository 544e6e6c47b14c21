"""The wire contract: msgspec Structs for every message, and nothing else."""

from .batch import BatchError, BatchLine, BatchResult
from .common import SCHEMA_VERSION, SUPPORTED_VERSIONS, ErrorCode, Message
from .control import CancelRequest, StatusRequest, WorkerStatus
from .deadletter import DeadLetter
from .frames import (
    AcceptedFrame,
    Choice,
    ErrorFrame,
    FinalFrame,
    FinishReason,
    Frame,
    HeartbeatFrame,
    TokensFrame,
    Usage,
)
from .generate import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    JobEnvelope,
    OutputOptions,
    Prompt,
    SamplingOptions,
    StopConditions,
    TextPrompt,
    TokensPrompt,
)
from .progress import Cancelled, Claim, Handoff, Record, Result, Step

__all__ = [
    "SCHEMA_VERSION",
    "SUPPORTED_VERSIONS",
    "AcceptedFrame",
    "BatchError",
    "BatchLine",
    "BatchResult",
    "CancelRequest",
    "Cancelled",
    "Claim",
    "ChatMessage",
    "ChatPrompt",
    "Choice",
    "DeadLetter",
    "ErrorCode",
    "ErrorFrame",
    "FinalFrame",
    "FinishReason",
    "Frame",
    "GenerateRequest",
    "Handoff",
    "HeartbeatFrame",
    "JobEnvelope",
    "Message",
    "OutputOptions",
    "Prompt",
    "Record",
    "Result",
    "SamplingOptions",
    "StatusRequest",
    "Step",
    "StopConditions",
    "TextPrompt",
    "TokensFrame",
    "TokensPrompt",
    "Usage",
    "WorkerStatus",
]

"""Every jetllm error a caller can catch is a JetllmError carrying the code the wire shows for it."""

from __future__ import annotations

from jetllm.adapterfiles import AdapterFileError
from jetllm.errors import JetllmError, RequestFailed, RequestRejected, WorkerSilent
from jetllm.producer.lora import AdapterError
from jetllm.schemas import ErrorCode
from jetllm.workers.control import ControlError


def test_coded_errors_share_one_base_and_keep_code_message_and_field():
    E = ErrorCode
    cases = [  # (error, code, message, field)
        (ControlError("busy", code=E.CONFLICT), E.CONFLICT, "busy", None),
        (AdapterFileError("too big", code=E.ADAPTER_INVALID), E.ADAPTER_INVALID, "too big", None),
        (AdapterError("not pushed", code=E.ADAPTER_NOT_FOUND), E.ADAPTER_NOT_FOUND, "not pushed", None),
        (RequestRejected(E.INVALID_REQUEST, "bad", field="$.n"), E.INVALID_REQUEST, "bad", "$.n"),
        (RequestFailed(E.ENGINE_ERROR, "boom"), E.ENGINE_ERROR, "engine_error: boom", None),
        (WorkerSilent("quiet"), E.WORKER_SILENT, "quiet", None),
        (JetllmError("plain"), E.INTERNAL, "plain", None),
    ]
    for exc, code, message, field in cases:
        assert isinstance(exc, JetllmError), exc
        assert (exc.code, exc.message, str(exc), exc.field) == (code, message, message, field), exc
    assert JetllmError.code == E.INTERNAL  # a per-error code never changes its class's

"""`/v1/files`: upload (multipart), list, retrieve, content, delete; the files live in NATS."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..batches.service import ApiError, BatchService, TooLarge, file_object
from .api_errors import answers_errors, counted
from .bodies import limited


def _too_large(size: str, max_file_bytes: int) -> TooLarge:
    return TooLarge(
        f"upload is {size} bytes; this server takes files of at most {max_file_bytes} bytes "
        "(--max-file-bytes): split the batch into several files",
        param="file",
    )


async def _form(request: Request, max_file_bytes: int) -> FormData:
    """The upload's form, refused with a 413 once its body passes the limit (with or without a
    content-length: a file part is never spooled to disk whole), a 400 when it is not a form."""
    limit = max_file_bytes + (64 << 10)  # the file, and the form around it
    counted = limited(request, limit, lambda size: _too_large(size, max_file_bytes))
    try:
        return await counted.form(max_files=1, max_fields=8, max_part_size=max_file_bytes + 1)
    except (MultiPartException, HTTPException) as exc:
        detail = getattr(exc, "message", None) or getattr(exc, "detail", "")
        raise ApiError(
            f"the upload is not a valid multipart form ({detail}): send the fields `file` and "
            "`purpose` as multipart/form-data",
            param="file",
        ) from None


def routes(service: Callable[[], BatchService]) -> list[Route]:
    @counted("files")
    @answers_errors
    async def upload(request: Request) -> Response:
        form = await _form(request, service().max_file_bytes)
        try:
            file = form.get("file")
            purpose = form.get("purpose")
            if not isinstance(file, UploadFile):
                raise ApiError("a multipart field `file` holding the file is required", param="file")
            if not isinstance(purpose, str):
                raise ApiError('the multipart field `purpose` is required ("batch")', param="purpose")
            data = await file.read(service().max_file_bytes + 1)
            info = await service().upload(data, file.filename or "upload.jsonl", purpose)
        finally:
            await form.close()
        return JSONResponse(file_object(info))

    @answers_errors
    async def list_files(request: Request) -> Response:
        purpose = request.query_params.get("purpose")
        files = await service().list_files(purpose)
        data = [file_object(f) for f in files]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )

    @answers_errors
    async def retrieve(request: Request) -> Response:
        return JSONResponse(file_object(await service().file(request.path_params["file_id"])))

    @answers_errors
    async def content(request: Request) -> Response:
        data = await service().content(request.path_params["file_id"])
        return Response(data, media_type="application/octet-stream")

    @answers_errors
    async def delete(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        await service().delete_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    return [
        Route("/v1/files", upload, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", retrieve, methods=["GET"]),
        Route("/v1/files/{file_id}", delete, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", content, methods=["GET"]),
    ]

"""`GET /v1/models` and `GET /v1/models/{model}`: what live workers serve, adapters included."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..openai.errors import OpenAIError
from .capacity import models
from .service import Gateway, error_response, json_response


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if not gw.fleet.live():
        try:
            await gw.fleet.reread(gw.config.retry_after)
        except OpenAIError as err:
            return error_response(err)
    return json_response({"object": "list", "data": models(gw.fleet.live())})


async def get_model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    name = request.path_params["model"]
    for m in models(gw.fleet.live()):
        if m["id"] == name:
            return json_response(m)
    return error_response(
        OpenAIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    )


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]

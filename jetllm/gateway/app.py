"""The gateway's ASGI app: its routes, and the NATS connection and registry watch it holds for
its life. `extra_routes` mounts more endpoint families (the files and batches APIs) beside these;
their handlers find the gateway as `request.app.state.gateway` (its `client`, `fleet`, `config`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from ..producer import Client
from ..subjects.names import Names
from . import chat_api, completions_api, health_api, models_api
from .capacity import FleetView
from .errors import GatewayError
from .service import Gateway, GatewayConfig, error_response


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(GatewayError(404, f"no endpoint {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(
        GatewayError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    )


def create_app(config: GatewayConfig, *, extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with Client(config.nats_url, namespace=config.namespace, name="jetllm-gateway") as client:
            fleet = FleetView(client.js, Names(config.namespace))
            await fleet.refresh()
            app.state.gateway = Gateway(config, client, fleet)
            async with anyio.create_task_group() as tg:
                tg.start_soon(fleet.watch)
                yield
                tg.cancel_scope.cancel()

    routes = [
        *models_api.routes,
        *chat_api.routes,
        *completions_api.routes,
        *health_api.routes,
        *extra_routes,
    ]
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_allowed}
    )

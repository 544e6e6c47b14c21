"""The gateway's ASGI app: its routes, and what it holds for its life: the NATS connection, the
registry watch and, with `config.batches`, the files and batches service and a batch runner.
`extra_routes` mounts more endpoint families beside these; their handlers find the gateway as
`request.app.state.gateway` (its `client`, `fleet`, `config`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from ..aio import supervised, task_group
from ..batches.runner import BatchRunner
from ..batches.service import BatchService
from ..openai.errors import OpenAIError
from ..producer import Client
from ..subjects.names import Names
from . import batches_api, chat_api, completions_api, files_api, health_api, models_api
from .capacity import FleetView
from .service import Gateway, GatewayConfig, error_response


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(OpenAIError(404, f"no endpoint {request.url.path}", code="not_found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(
        OpenAIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    )


def create_app(config: GatewayConfig, *, extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    opened: list[BatchService] = []  # the routes are built now, the service once NATS is up

    def batch_service() -> BatchService:
        return opened[0]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with Client(config.nats_url, namespace=config.namespace, name="jetllm-gateway") as client:
            fleet = FleetView(client.js, Names(config.namespace))
            await fleet.refresh()
            app.state.gateway = Gateway(config, client, fleet)
            async with task_group() as tg:
                tg.start_soon(fleet.watch)
                if (b := config.batches) is not None:
                    service = await BatchService.open(
                        client.js, client.names, ack_wait=b.ack_wait, max_file_bytes=b.max_file_bytes
                    )
                    opened.append(service)
                    runner = BatchRunner.configured(client, service, b)
                    tg.start_soon(supervised, "batch runner", runner.serve)
                yield
                tg.cancel_scope.cancel()

    batch_routes = (
        [*files_api.routes(batch_service), *batches_api.routes(batch_service)] if config.batches else []
    )

    routes = [
        *models_api.routes,
        *chat_api.routes,
        *completions_api.routes,
        *health_api.routes,
        *batch_routes,
        *extra_routes,
    ]
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_allowed}
    )

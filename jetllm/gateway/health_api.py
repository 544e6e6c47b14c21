"""`GET /health` (for load balancers) and `GET /metrics` (Prometheus)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .capacity import serving
from .metrics import CONTENT_TYPE
from .service import Gateway, json_response


async def health(request: Request) -> Response:
    """200 when this gateway can take a request: NATS is reachable and some worker serves a model."""
    gw: Gateway = request.app.state.gateway
    connected = gw.client.nc.is_connected if gw.client._nc is not None else False
    served = sorted({r.model for r in gw.fleet.live() if serving(r)})
    ok = connected and bool(served)
    body = {"status": "ok" if ok else "unavailable", "nats": connected, "models": served}
    return json_response(body, 200 if ok else 503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(gw.metrics.render(), media_type=CONTENT_TYPE)


routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])]

"""A gateway in a thread of the test process (its own event loop), for the `openai` SDK to call."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import uvicorn
from starlette.routing import BaseRoute

from jetllm.gateway import GatewayConfig, create_app


class GatewayThread:
    def __init__(self, config: GatewayConfig, extra_routes: Sequence[BaseRoute] = ()) -> None:
        self.config = config
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(config, extra_routes=extra_routes), log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()

"""`jetllm gateway`: an OpenAI-compatible HTTP server in front of the job system.

Each request becomes one job per prompt on the queues workers already drain; nothing is kept
between requests but caches (the registry, queue depths), so any number of gateways can run
behind a load balancer. Imports neither vLLM nor torch.
"""

from .app import create_app
from .service import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig", "create_app"]

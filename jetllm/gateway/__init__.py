"""The OpenAI-compatible HTTP gateway (Starlette): each request becomes a job on NATS."""

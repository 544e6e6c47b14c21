"""Moving a prompt's KV blocks from a prefill engine to a decode engine through NATS.

Three parts, each with one job: `connector.py` runs inside vLLM's engine processes and only copies
whole blocks between the engine's KV cache and a local block file (no network there);
`blockfile.py` is that file's format; `transport.py` carries a block file over NATS, checked
block by block. The prefill and decode roles (workers/roles/) put them together.
"""

"""`jetllm bench`: one workload against AsyncLLM directly, through jetllm, and vLLM's HTTP server."""

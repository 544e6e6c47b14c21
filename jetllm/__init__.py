"""jetllm: LLM inference jobs on NATS JetStream, served by stateless vLLM workers."""

__version__ = "0.1.0"

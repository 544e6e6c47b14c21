# A jetllm worker on vLLM's GPU image. Build from the repository root:
#   docker build -f infra/docker/worker.Dockerfile -t jetllm-worker .
ARG VLLM_IMAGE=vllm/vllm-openai:latest
FROM ${VLLM_IMAGE}
WORKDIR /opt/jetllm
COPY pyproject.toml README.md ./
COPY jetllm ./jetllm
# vLLM is already in the base image: install jetllm without pulling another vLLM.
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir "nats-py>=2.16,<3" "msgspec>=0.19" "anyio>=4.4" "prometheus-client>=0.20"
ENTRYPOINT ["jetllm", "worker"]

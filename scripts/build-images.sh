#!/usr/bin/env bash
# Build Kvasir's container images with podman (or buildah) from docker/*.Dockerfile:
#   runtime-cpu   ghcr.io/kvasir-project/kvasir:VERSION-cpu  `kvasir serve` on CPUs: CPU torch, no CUDA, no Triton
#   runtime-cuda  ghcr.io/kvasir-project/kvasir:VERSION      `kvasir serve` on NVIDIA GPUs (the operator's default image)
#   operator      ghcr.io/kvasir-project/kvasir-operator:VERSION  the chart's default image
# VERSION is pyproject.toml's, which is the chart's appVersion. docs/images.md explains every option.
#
#   scripts/build-images.sh [options] [runtime-cpu|runtime-cuda|operator ...] [-- BUILD-OPTIONS]
#   (default: all three; BUILD-OPTIONS go to `podman build`/`buildah build`, e.g. --no-cache)
#     --base IMAGE      base image of every stage (a Debian-based image with python3 and
#                       python3-venv); default: the Dockerfiles' own, the official Python image
#     --debian-base     make a Debian bookworm base with mmdebstrap (Debian's python3, 3.11),
#                       import it into podman as localhost/kvasir-debian:bookworm and build on it:
#                       nothing is pulled from a container registry
#     --wheels DIR      a folder of wheels the CPU image's build may take torch from (mounted
#                       read-only), e.g. torch's CPU wheel where download.pytorch.org is unreachable
#     --torch-cuda-index URL  where the CUDA image's torch comes from; default: PyPI (CUDA 13.0);
#                       e.g. https://download.pytorch.org/whl/cu128 (CUDA 12.8)
#     --ca-bundle FILE  the CA bundle builds trust (HTTPS through a re-signing proxy); default:
#                       $PIP_CERT, $REQUESTS_CA_BUNDLE or $SSL_CERT_FILE when one is set
#     --tool podman|buildah   default: podman if installed, else buildah
#     --times FILE      append "image seconds size" for each image built to FILE (the size in
#                       bytes with podman; buildah prints it rounded, "180 MB")
#     --list            print each target and its tag, and build nothing
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY=ghcr.io/kvasir-project
DEBIAN_BASE=localhost/kvasir-debian:bookworm
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY=${DEBIAN_SECURITY:-http://deb.debian.org/debian-security}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

BASE="" MAKE_DEBIAN_BASE=no WHEELS="" TOOL="" TIMES="" LIST=no TORCH_CUDA_INDEX=""
BUILD_OPTIONS=()
CA_BUNDLE=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-}}}
TARGETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=${2:?--base needs an image}; shift 2 ;;
    --debian-base) MAKE_DEBIAN_BASE=yes; shift ;;
    --wheels) WHEELS=$(cd "${2:?--wheels needs a folder}" && pwd); shift 2 ;;
    --ca-bundle) CA_BUNDLE=${2:?--ca-bundle needs a file}; shift 2 ;;
    --tool) TOOL=${2:?--tool needs podman or buildah}; shift 2 ;;
    --times) TIMES=${2:?--times needs a file}; shift 2 ;;
    --list) LIST=yes; shift ;;
    --torch-cuda-index) TORCH_CUDA_INDEX=${2:?--torch-cuda-index needs a URL}; shift 2 ;;
    --) shift; BUILD_OPTIONS=("$@"); break ;;
    runtime-cpu | runtime-cuda | operator) TARGETS+=("$1"); shift ;;
    -h | --help) usage ;;
    *) echo "build-images.sh: unknown argument $1" >&2; usage ;;
  esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(runtime-cpu runtime-cuda operator)

# The chart's appVersion and the operator's default runtime image carry this version too
# (tests/chart/test_images.py checks that the tags below are the ones they name).
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
tag_of() {
  case "$1" in
    runtime-cpu) echo "$REGISTRY/kvasir:$VERSION-cpu" ;;
    runtime-cuda) echo "$REGISTRY/kvasir:$VERSION" ;;
    operator) echo "$REGISTRY/kvasir-operator:$VERSION" ;;
  esac
}
if [ "$LIST" = yes ]; then
  for target in "${TARGETS[@]}"; do echo "$target $(tag_of "$target")"; done
  exit 0
fi

if [ -z "$TOOL" ]; then
  if command -v podman >/dev/null 2>&1; then TOOL=podman; else TOOL=buildah; fi
fi
command -v "$TOOL" >/dev/null 2>&1 || {
  echo "build-images.sh: $TOOL is not installed (Debian: apt-get install podman, or buildah)" >&2
  exit 1
}

# A Debian base made from Debian's packages alone: minbase plus python3 and its venv module (the
# Dockerfiles make a virtual environment), CA certificates, and no documentation but copyrights.
# Debian's merged-usr hook merges /usr itself, so apt need not choose usrmerge, which brings perl
# (about 50 MB).
make_debian_base() {
  command -v mmdebstrap >/dev/null 2>&1 || {
    echo "build-images.sh: --debian-base needs mmdebstrap (Debian: apt-get install mmdebstrap)" >&2
    exit 1
  }
  echo "== $DEBIAN_BASE: mmdebstrap $DEBIAN_SUITE ($DEBIAN_MIRROR)" >&2
  local tarball
  tarball=$(mktemp --suffix=.tar)
  # shellcheck disable=SC2064
  trap "rm -f '$tarball'" EXIT
  # shellcheck disable=SC2016 # the customize hook's $1 (the new root) is mmdebstrap's to expand
  mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$DEBIAN_SUITE" "$tarball" \
    "deb $DEBIAN_MIRROR $DEBIAN_SUITE main" \
    "deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main" \
    "deb $DEBIAN_SECURITY $DEBIAN_SUITE-security main" >&2
  local changes=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]')
  if [ "$TOOL" = podman ]; then
    podman import "${changes[@]}" "$tarball" "$DEBIAN_BASE" >/dev/null
  else
    local container
    container=$(buildah from scratch)
    buildah add "$container" "$tarball" / >/dev/null # a tar archive is unpacked, as ADD does
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --env LANG=C.UTF-8 --cmd /bin/bash "$container"
    buildah commit --rm "$container" "$DEBIAN_BASE" >/dev/null
  fi
  rm -f "$tarball"
  trap - EXIT
}

if [ "$MAKE_DEBIAN_BASE" = yes ]; then
  start=$(date +%s)
  make_debian_base
  echo "== $DEBIAN_BASE made in $(($(date +%s) - start)) s" >&2
  [ -n "$BASE" ] || BASE=$DEBIAN_BASE
fi

SOURCE=$(sed -n 's/^sources: \[\(.*\)\]$/\1/p' charts/kvasir/Chart.yaml)
# The commit the images come from; "-dirty" when what they copy differs from it.
IMAGE_INPUTS=(docker pyproject.toml README.md cli runtime operator kernels simulator router observability crds)
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$REVISION" != unknown ] && ! git diff --quiet HEAD -- "${IMAGE_INPUTS[@]}"; then
  REVISION="$REVISION-dirty"
fi

# What build steps may use and no image keeps, mounted over paths every Debian base has (so no
# empty mount point stays behind): the CA bundle over the system's, which pip is told to trust
# (PIP_CERT in the Dockerfiles), and, for the CPU image only, the wheel folder on /mnt, where
# pip looks for wheels (PIP_FIND_LINKS). The folder stays away from the other images: a local
# torch 2.13.0+cpu satisfies "torch==2.13.0" too.
MOUNTS=()
if [ -n "$CA_BUNDLE" ]; then
  [ -r "$CA_BUNDLE" ] || { echo "build-images.sh: cannot read the CA bundle $CA_BUNDLE" >&2; exit 1; }
  MOUNTS+=(--volume "$(readlink -f "$CA_BUNDLE"):/etc/ssl/certs/ca-certificates.crt:ro")
fi
COMMON=(--build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" --build-arg "SOURCE=$SOURCE")
if [ -n "$BASE" ]; then COMMON+=(--build-arg "PYTHON_IMAGE=$BASE"); fi
# HTTP(S) proxies of this shell reach the build steps too (build arguments Docker and podman know).
for proxy in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
  if [ -n "${!proxy:-}" ]; then COMMON+=(--build-arg "$proxy=${!proxy}"); fi
done

image_size() { # what `podman image inspect` calls Size, and what podman and buildah list
  if [ "$TOOL" = podman ]; then
    podman image inspect --format '{{.Size}}' "$1"
  else
    buildah images --noheading --format '{{.Size}}' "$1"
  fi
}

SUMMARY=()
for target in "${TARGETS[@]}"; do
  tag=$(tag_of "$target") extra=()
  case "$target" in
    runtime-cpu)
      dockerfile=docker/runtime.Dockerfile
      extra+=(--target runtime-cpu)
      # With a wheel folder torch comes from it alone (its index may be unreachable).
      if [ -n "$WHEELS" ]; then extra+=(--volume "$WHEELS:/mnt:ro" --build-arg "TORCH_CPU_INDEX="); fi
      ;;
    runtime-cuda)
      dockerfile=docker/runtime.Dockerfile
      extra+=(--target runtime-cuda)
      if [ -n "$TORCH_CUDA_INDEX" ]; then extra+=(--build-arg "TORCH_CUDA_INDEX=$TORCH_CUDA_INDEX"); fi
      ;;
    operator) dockerfile=docker/operator.Dockerfile ;;
  esac
  echo "== $tag ($target, base ${BASE:-as the Dockerfile says}, $TOOL)" >&2
  start=$(date +%s)
  if [ "$TOOL" = podman ]; then
    podman build "${COMMON[@]}" ${MOUNTS[@]+"${MOUNTS[@]}"} "${extra[@]}" "${BUILD_OPTIONS[@]}" -f "$dockerfile" -t "$tag" .
  else
    buildah build "${COMMON[@]}" ${MOUNTS[@]+"${MOUNTS[@]}"} "${extra[@]}" "${BUILD_OPTIONS[@]}" -f "$dockerfile" -t "$tag" .
  fi
  seconds=$(($(date +%s) - start))
  size=$(image_size "$tag")
  SUMMARY+=("$tag $seconds $size")
  if [ -n "$TIMES" ]; then echo "$tag $seconds $size" >>"$TIMES"; fi
done

echo "== built (image, seconds, size):" >&2
printf '%s\n' "${SUMMARY[@]}" >&2

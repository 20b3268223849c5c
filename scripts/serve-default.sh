#!/usr/bin/env bash
# Set up the environment, then serve the embedded default model (SmolLM2-135M-Instruct, bundled, no
# network) over the OpenAI-compatible HTTP API on http://localhost:8000 (Ctrl+C drains and stops).
# Extra arguments go to `kvasir serve` (e.g. --port 9000, --api-key KEY).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec kvasir serve --model embedded "$@"

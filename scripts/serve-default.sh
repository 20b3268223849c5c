#!/usr/bin/env bash
# Set up the environment, then serve the embedded default model (SmolLM2-135M-Instruct, bundled, no
# network) over the OpenAI-compatible HTTP API on http://127.0.0.1:8000, this machine only (Ctrl+C
# drains and stops). Extra arguments go to `kvasir serve` (e.g. --port 9000; --host 0.0.0.0 with
# --api-key KEY to serve other machines). The set-up installs only what serving needs, once: a
# later launch finds it done (scripts/setup.sh) and starts at once.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec kvasir serve --model embedded "$@"

#!/usr/bin/env bash
# Set up the environment, then run the embedded default model (SmolLM2-135M-Instruct, bundled,
# no network) on the example prompts and print the outputs and the throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec kvasir generate --model embedded --input examples/prompts.jsonl "$@"

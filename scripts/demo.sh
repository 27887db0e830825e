#!/usr/bin/env bash
# Set up (if needed) and run the demo: serve the tiny Qwen3.5-shaped hybrid on
# loopback, send one chat completion, print the answer and the KV cache plan.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
exec python scripts/demo.py "$@"

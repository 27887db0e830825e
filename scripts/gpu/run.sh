#!/usr/bin/env bash
# The prepared GPU device run (see scripts/gpu/device_run.py and docs/cuda.md).
#
#   bash scripts/gpu/run.sh pack              # here: vLLM's Python tree + wheels into .gpu-bundle/
#   bash scripts/gpu/run.sh rehearse [ARGS]   # here: the same run on CPU, results in .gpu-bundle/rehearsal/out
#   bash scripts/gpu/run.sh device [ARGS]     # on the GPU machine: results under $OUT
#
# ARGS: --parts imports,tier,timings,copies,engines (default: all, in that order).
# The device call carries .gpu-bundle/device and .gpu-bundle/manifest.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?usage: run.sh pack|rehearse|device [--parts ...]}
shift
case "$mode" in
  pack) exec .venv/bin/python scripts/gpu/bundle.py "$@" ;;
  rehearse) exec .venv/bin/python scripts/gpu/device_run.py --mode rehearse "$@" ;;
  device) exec python3 scripts/gpu/device_run.py --mode device --out "${OUT:?set by the device tool}" "$@" ;;
  *) echo "unknown mode $mode (pack, rehearse, device)" >&2; exit 2 ;;
esac

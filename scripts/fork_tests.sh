#!/usr/bin/env bash
# The fork's tests: write the fork with its wheel, install the wheel in an
# environment without vllm-hybrid (every other package of this one, linked),
# run the tests that went into the fork's tests/ tree there, then vLLM's own
# tests against the overlay (scripts/upstream_tests.sh --fork).
#
#   bash scripts/fork_tests.sh OUT_DIR [--sdist PATH]
#
# PYTHON (default .venv/bin/python) is this repository's environment: vLLM
# with vllm-hybrid installed, CPU or CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT=${1:?usage: fork_tests.sh OUT_DIR [--sdist PATH]}
shift
"$PY" -m vllm_hybrid.cli fork "$OUT" --wheel "$@"
FORK_PY=$("$PY" - "$OUT" <<'EOF'
import sys
from pathlib import Path

from vllm_hybrid.tools.fork.wheel import fork_environment

out = Path(sys.argv[1])
print(fork_environment(next((out / "dist").glob("*.whl")), out / "venv"))
EOF
)
bash scripts/upstream_tests.sh fetch
DEPS=$(ls -d "${UPSTREAM_TESTS_DIR:-$ROOT/.upstream-tests}"/deps-*)
# the tests the series added (test modules, not their helpers)
mapfile -t TESTS < <(git -C "$OUT" diff --name-only --diff-filter=A \
  "$(git -C "$OUT" rev-list --max-parents=0 HEAD)" HEAD -- 'tests/*' | grep '/test_[^/]*\.py$')
(cd "$OUT" && env -u PYTHONPATH HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONPATH="$ROOT/tests_upstream:$DEPS" \
  "$FORK_PY" -m pytest "${TESTS[@]}" -q -p no:cacheprovider \
  -p upstream_overlay --overlay=fork --hub-redirect=no)
PYTHON=$PY bash scripts/upstream_tests.sh --fork "$FORK_PY"

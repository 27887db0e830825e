#!/usr/bin/env bash
# Run vLLM's own tests/v1/core, and the tests of vLLM that touch a symbol the
# patch registry replaces (tests_upstream/selection.json, less the "Not run"
# rows of docs/upstream-tests.md), with the overlay on and again off
# (VLLM_HYBRID_KV=0), and fail if any test's outcome differs, apart from the
# deviations listed in docs/upstream-tests.md.
#
#   bash scripts/upstream_tests.sh [PYTEST_ARGS]  fetch (if needed), run both modes, compare
#   bash scripts/upstream_tests.sh fetch          only fetch and extract
#   bash scripts/upstream_tests.sh --fork PYTHON [PYTEST_ARGS]
#       the overlay on against the fork: PYTHON is the interpreter of an
#       environment with the fork's wheel and no vllm-hybrid (vllm-hybrid fork
#       --wheel; tests/tools/test_fork_wheel.py makes one); deviations are
#       the "Deviations of the fork" rows of docs/upstream-tests.md
#
# vLLM's tests are not part of this repository: they are extracted from the
# vLLM sdist on the package index into .upstream-tests/ (git-ignored, reused
# while complete). Set UPSTREAM_TESTS_DIR to cache them elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=$("$PY" -c 'import vllm_hybrid; print(vllm_hybrid.SUPPORTED_VLLM_VERSION)')
CACHE=${UPSTREAM_TESTS_DIR:-$ROOT/.upstream-tests}
SRC=$CACHE/vllm-$VERSION
DEPS=$CACHE/deps-$VERSION
RESULTS=$CACHE/results
# Guard against hangs only: one mode takes about a minute on 2 cores.
# (--foreground keeps pytest in our process group, so stopping this script
# stops it too.)
RUN_TIMEOUT=${UPSTREAM_TESTS_TIMEOUT:-600}

fetch() {
  [ -f "$SRC/.complete" ] && [ -f "$DEPS/.complete" ] && return 0
  mkdir -p "$CACHE"
  local tmp
  tmp=$(mktemp -d "$CACHE/.fetch.XXXXXX")
  echo "[upstream-tests] fetching the vllm==$VERSION sdist (tests/ only is kept)" >&2
  # pip builds the sdist's metadata before saving it; VLLM_TARGET_DEVICE=empty
  # skips every extension and VLLM_VERSION_OVERRIDE keeps the version free of
  # a "+empty" suffix that pip would reject as inconsistent.
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VERSION \
    "$PY" -m pip download --quiet --no-deps --no-binary vllm \
    "vllm==$VERSION" -d "$tmp/dl"
  tar -xzf "$tmp/dl/vllm-$VERSION.tar.gz" -C "$tmp" \
    "vllm-$VERSION/tests" "vllm-$VERSION/pyproject.toml" \
    "vllm-$VERSION/requirements/test/cpu.txt"
  # tests/conftest.py imports tblib; take upstream's pin from its CPU test
  # requirements and install it outside the project's environment.
  local tblib
  tblib=$(grep -E '^tblib==' "$tmp/vllm-$VERSION/requirements/test/cpu.txt")
  rm -rf "$DEPS"
  "$PY" -m pip install --quiet --no-deps --target "$DEPS" "$tblib"
  touch "$DEPS/.complete"
  rm -rf "$SRC"
  mv "$tmp/vllm-$VERSION" "$SRC"
  touch "$SRC/.complete"
  rm -rf "$tmp"
}

# run_mode on|off|fork: vLLM's tests/v1/core and the selection in one pytest
# process (one import of vLLM; the selection runs after tests/v1/core).
run_mode() {
  local mode=$1 switch rc start python=$PY path="$ROOT/tests_upstream:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
  case $mode in
    on) switch=(env -u VLLM_HYBRID_KV) ;;
    off) switch=(env VLLM_HYBRID_KV=0) ;;
    # nothing of this repository's package on the fork's path
    fork) switch=(env -u VLLM_HYBRID_KV); python=$FORK_PY; path="$ROOT/tests_upstream:$DEPS" ;;
  esac
  start=$SECONDS
  set +e
  (cd "$SRC" && "${switch[@]}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    PYTHONPATH="$path" \
    timeout --foreground -k 30 "$RUN_TIMEOUT" "$python" -m pytest tests/v1/core "${SELECTED[@]}" \
    -q -p no:cacheprovider \
    -p upstream_overlay --overlay="$mode" --outcomes-json="$RESULTS/$mode.json" \
    "${PYTEST_ARGS[@]}" >"$RESULTS/$mode.log" 2>&1)
  rc=$?
  set -e
  echo "[upstream-tests] overlay $mode: pytest exit $rc after $((SECONDS - start)) s:" \
    "$(tail -1 "$RESULTS/$mode.log")" >&2
  case $rc in
    0 | 1) return 0 ;; # 1: some tests failed; the comparison judges them
    5) echo "[upstream-tests] overlay $mode: no test collected from $SRC/tests/v1/core" >&2 ;;
    124) echo "[upstream-tests] overlay $mode: timed out after $RUN_TIMEOUT s" >&2 ;;
    *) echo "[upstream-tests] overlay $mode: pytest failed (exit $rc):" >&2
       tail -20 "$RESULTS/$mode.log" >&2 ;;
  esac
  echo "[upstream-tests] full log: $RESULTS/$mode.log" >&2
  return 1
}

fetch
[ "${1:-}" = fetch ] && exit 0
OTHER=off
if [ "${1:-}" = --fork ]; then
  OTHER=fork
  FORK_PY=${2:?--fork needs the python of the fork environment}
  shift 2
fi
PYTEST_ARGS=("$@")
# The registry's selection outside tests/v1/core; fails on a "Not run" row
# that matches no selected test. (tests/test_upstream_selection.py checks
# the selection against the registry and a fresh scan of the fetched tests.)
SELECTED=()
SELECTED_LIST=$("$PY" "$ROOT/tests_upstream/select_tests.py" run-list "$ROOT/docs/upstream-tests.md")
[ -z "$SELECTED_LIST" ] || mapfile -t SELECTED <<<"$SELECTED_LIST"
rm -rf "$RESULTS"
mkdir -p "$RESULTS"
# Both modes run side by side, and both to the end even when one fails, so
# one log shows both problems. OpenMP threads wait passively: spinning idle
# threads of one run took the other's core.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
run_mode on & on_pid=$!
run_mode "$OTHER" & off_pid=$!
wait "$on_pid" && on_ok=0 || on_ok=1
wait "$off_pid" && off_ok=0 || off_ok=1
[ "$on_ok$off_ok" = 00 ] || exit 1
"$PY" "$ROOT/tests_upstream/compare_outcomes.py" \
  "$RESULTS/on.json" "$RESULTS/$OTHER.json" "$ROOT/docs/upstream-tests.md"

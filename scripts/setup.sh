#!/usr/bin/env bash
# Create .venv and install vllm-hybrid with the CPU and test extras.
# Idempotent: does nothing when the environment already matches pyproject.toml
# and scripts/constraints.txt (the pinned versions every install resolves to).
# --freeze: after setting up, rewrite scripts/constraints.txt from this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
CONSTRAINTS=scripts/constraints.txt
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# The native TurboQuant kernel sources count too: changing them must rebuild.
want=$(cat pyproject.toml setup.py CMakeLists.txt "$CONSTRAINTS" csrc/* | sha256sum | cut -c1-16)
if [ "$(cat .setup-stamp 2>/dev/null || true)" != "$want" ] \
   || ! python -c "import vllm, vllm_hybrid" >/dev/null 2>&1; then
  python -m pip install --quiet --upgrade pip
  # torch first: the pinned CPU build comes from pip's configured find-links.
  python -m pip install --quiet -c "$CONSTRAINTS" "torch==2.13.0"
  # No build isolation: setup.py compiles csrc/ against the torch installed
  # above, so the kernel's ABI matches the torch it runs with (docs/turboquant.md).
  python -m pip install --quiet -c "$CONSTRAINTS" "setuptools>=77" wheel
  python -m pip install --quiet -c "$CONSTRAINTS" --no-build-isolation -e ".[cpu,test]"
  # The registry's torchvision/torchaudio/torchcodec are CUDA builds that
  # break CPU imports (operator torchvision::nms does not exist).
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  echo "$want" > .setup-stamp
fi
python -c "import vllm, vllm_hybrid; print('[setup] vllm', vllm.__version__, '+ vllm-hybrid', vllm_hybrid.__version__)" 2>/dev/null
if [ "${1:-}" = "--freeze" ]; then
  { sed -n '/^#/p' "$CONSTRAINTS"; python -m pip freeze --exclude-editable | grep -v '^#'; } > "$CONSTRAINTS.new"
  mv "$CONSTRAINTS.new" "$CONSTRAINTS"
  echo "[setup] wrote $CONSTRAINTS"
fi

#!/usr/bin/env bash
# Install nanolight and its dependencies into the current Python environment.
#   bash scripts/install.sh          # runtime only
#   bash scripts/install.sh dev      # plus the test tools, at the versions in constraints.txt
# Why a script: a bare `torch` requirement makes pip pull a multi-GB CUDA build. Where no torch
# is installed yet we ask for the pinned release first (on CPU-only machines of this project it is
# served from a local CPU wheel), and never touch a torch the user already has (e.g. a CUDA build).
# The dev install is pinned (constraints.txt, the versions the suite last passed with) so that a
# fresh machine gets what CI tested; the runtime install keeps pyproject's floors.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=${1:-}
if [ -n "$extras" ]; then
    "$PY" -m pip install --quiet -c constraints.txt -e ".[$extras]"
else
    "$PY" -m pip install --quiet -e .
fi

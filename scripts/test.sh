#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs every check CI runs: ruff, mypy, the tests.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k config`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
echo "==> ruff"
.venv/bin/ruff check worker tests scripts bench
.venv/bin/ruff format --check worker tests scripts bench
echo "==> mypy"
.venv/bin/mypy
echo "==> pytest"
.venv/bin/python -m pytest -ra "$@"

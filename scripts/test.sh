#!/usr/bin/env bash
# The project's test command: lint, strict typing, then the test suite (slow stress runs and
# GPU-only tests excluded; run them with `pytest -m slow` / on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m ruff check rlix_plugins tests benchmarks gates
"$PY" -m mypy
"$PY" -m pytest -m "not slow and not gpu" "$@"

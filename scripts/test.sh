#!/usr/bin/env bash
# The project's test command: lint, strict typing, then the test suite (slow stress runs and
# GPU-only tests excluded; run them with `pytest -m slow` / on a GPU box). veRL's tests run in
# the .venv-verl environment scripts/setup.sh builds (they skip, loudly, where it is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m ruff check rlix_plugins tests benchmarks
"$PY" -m mypy
"$PY" -m pytest -m "not slow and not gpu and not verl" "$@"
if [ -x .venv-verl/bin/python ]; then
  # veRL's real routing and checkpoint-engine tests are part of the CI run (marked slow only
  # because each starts real vLLM servers in Ray actors).
  .venv-verl/bin/python -m pytest -m "verl and not gpu" "$@"
else
  "$PY" -m pytest -m "verl and not gpu" "$@"
fi

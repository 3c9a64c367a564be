#!/usr/bin/env bash
# The project's test command: lint, strict typing, then the test suite (slow stress runs and
# GPU-only tests excluded; run them with `pytest -m slow` / on a GPU box). veRL's tests run in
# the .venv-verl environment scripts/setup.sh builds (they skip, loudly, where it is absent).
#
# The veRL suite runs alongside the main one (RLIX_SERIAL_TESTS=1 runs them one after the
# other): both spend most of their time starting Ray workers and vLLM engines one process at a
# time (the veRL suite alone kept 2 cores 62% busy), so side by side they take less than the
# sum (README: 1,161 s against about 1,700 s on 2 cores, 2026-11-28). Each runs its own local
# Ray; no test binds a fixed port (grep). Its output is printed when both are done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
VERL_PY="$PY"
if [ -x .venv-verl/bin/python ]; then
  # veRL's real routing and checkpoint-engine tests are part of the CI run (marked verl, each
  # starts real vLLM servers in Ray actors).
  VERL_PY=.venv-verl/bin/python
fi

"$PY" -m ruff check rlix_plugins tests benchmarks

if [ "${RLIX_SERIAL_TESTS:-0}" = "1" ]; then
  "$PY" -m mypy
  "$PY" -m pytest -m "not slow and not gpu and not verl" "$@"
  "$VERL_PY" -m pytest -m "verl and not gpu" "$@"
  exit 0
fi

scratch=$(mktemp -d)
verl_pid=""
stop_verl() {
  if [ -n "$verl_pid" ] && kill -0 "$verl_pid" 2>/dev/null; then
    kill "$verl_pid" 2>/dev/null || true
    wait "$verl_pid" 2>/dev/null || true
  fi
  rm -rf "$scratch"
}
trap stop_verl EXIT
# Its own pytest temp root and no shared cache: two sessions never touch each other's files.
"$VERL_PY" -m pytest -m "verl and not gpu" -p no:cacheprovider --basetemp="$scratch/tmp" "$@" \
  > "$scratch/verl.log" 2>&1 &
verl_pid=$!

status=0
"$PY" -m mypy || status=$?
if [ "$status" -eq 0 ]; then
  "$PY" -m pytest -m "not slow and not gpu and not verl" "$@" || status=$?
fi
if [ "$status" -ne 0 ]; then
  echo "===== veRL suite stopped (mypy or the main suite failed); its output so far ====="
  tail -n 40 "$scratch/verl.log"
  exit "$status"  # the trap stops the veRL suite
fi
verl_status=0
wait "$verl_pid" || verl_status=$?
verl_pid=""
echo "===== veRL suite (.venv-verl: $([ "$VERL_PY" = "$PY" ] && echo absent || echo present)) ====="
cat "$scratch/verl.log"
exit "$verl_status"

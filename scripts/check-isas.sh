#!/usr/bin/env bash
# The tests that compute in low precision (marked `low_precision` from their code: tests/low_precision.py), run
# again with oneDNN held to the instruction sets of other CPUs (ONEDNN_MAX_CPU_ISA), whose bf16 kernels round
# differently: AVX2 (most laptops), AVX512_CORE (AVX-512 without bf16 instructions) and, on a CPU with AMX, whose
# own run used AMX, AVX512_CORE_BF16 (AVX-512-BF16 without AMX). One line per instruction set; exit status 1 when
# any fails, after the failing tests' log.
set -euo pipefail
cd "$(dirname "$0")/.."
caps=(AVX2 AVX512_CORE)
if grep -q -w amx_bf16 /proc/cpuinfo 2>/dev/null; then
    caps+=(AVX512_CORE_BF16)
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
for cap in "${caps[@]}"; do
    start=$SECONDS
    if ONEDNN_MAX_CPU_ISA=$cap .venv/bin/python -m pytest -q -p no:cacheprovider -m low_precision >"$log" 2>&1; then
        echo "check-isas: ONEDNN_MAX_CPU_ISA=$cap: $(tail -n 1 "$log" | tr -d '=' | xargs) ($((SECONDS - start)) s)"
    else
        tail -n 40 "$log"
        echo "check-isas: ONEDNN_MAX_CPU_ISA=$cap: FAILED: $(grep -c '^FAILED\|^ERROR' "$log") test(s) above"
        status=1
    fi
done
exit "$status"

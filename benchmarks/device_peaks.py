"""The device's measured ceilings: dense bf16 matrix-product rate and device-memory bandwidth.

    python benchmarks/device_peaks.py --json peaks.json          # GPU: 8192³ products, 2 GiB copies

MFU and the decode floor are taken against these rather than the spec sheet. Inputs are random (zeros run
faster), two operand sets alternate so that no run reads the other's results from cache, and each figure is
the median of `--repeats` timed runs after warm-up (CUDA events on a GPU, the wall clock on a CPU).
The copy counts the bytes read and the bytes written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def median_seconds(run, repeats: int, device: torch.device) -> float:
    """Median time of `run(i)` over `repeats` calls, after three warm-up calls."""
    for i in range(3):
        run(i)
    times = []
    for i in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            run(i)
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def matmul_flops(size: int, repeats: int, device: torch.device) -> float:
    pairs = [[torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    seconds = median_seconds(lambda i: torch.matmul(*pairs[i % 2], out=out), repeats, device)
    return 2 * size**3 / seconds


def copy_bandwidth(gib: float, repeats: int, device: torch.device) -> float:
    elements = int(gib * 2**30) // 4
    sources = [torch.rand(elements, device=device) for _ in range(2)]
    target = torch.empty(elements, device=device)
    seconds = median_seconds(lambda i: target.copy_(sources[i % 2]), repeats, device)
    return 2 * target.nbytes / seconds


def measure(device: torch.device, size: int = 8192, copy_gib: float = 2.0, repeats: int = 10) -> dict:
    """Both ceilings, with what they were measured on (what `--json` writes)."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bf16_flops": matmul_flops(size, repeats, device),
        "bandwidth_bytes": copy_bandwidth(copy_gib, repeats, device),
        "matmul_size": size,
        "copy_gib": copy_gib,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=8192, help="square bf16 matrix product of this size")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="GiB copied device to device")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    peaks = measure(torch.device(args.device), args.size, args.copy_gib, args.repeats)
    print(
        f"{peaks['device']}: bf16 matmul {args.size}³ {peaks['bf16_flops'] / 1e12:.1f} TFLOP/s; "
        f"copy of {args.copy_gib:g} GiB {peaks['bandwidth_bytes'] / 1e9:.0f} GB/s (read + write)"
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(peaks, file, indent=1)


if __name__ == "__main__":
    main()

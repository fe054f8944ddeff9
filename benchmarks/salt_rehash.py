"""What the depth salt costs vLLM's engine thread: recurfit's scheduler gives each request its depth's cache salt and
hashes its prompt's blocks again (`scheduler.salt_by_depth`), on the thread that schedules every batch, after vLLM
hashed them once with the client's salt in its input thread. A request the middleware salted already keeps vLLM's
hashes (`middleware.with_salt`).

    .venv-vllm/bin/python benchmarks/salt_rehash.py                      # prompts of 512 to 32768 tokens
    .venv-vllm/bin/python benchmarks/salt_rehash.py --lengths 4096 --repeats 50

For each prompt length, the median over the repeats of: vLLM's own hashing of the prompt (making its `Request`
with the engine's block hasher, as its input thread does), the scheduler's salt and rehash of a request with the
client's salt (none), and the same for a request whose body the middleware salted. vLLM's defaults: sha256, blocks
of 16 tokens (its CUDA default; the CPU build's is 128, fewer and longer blocks).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 32768], help="prompt lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per hashed block")
    args = parser.parse_args()

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from recurfit.serving.depth import Limits
    from recurfit.serving.scheduler import salt_by_depth

    init_none_hash(sha256)
    hasher = get_request_block_hasher(args.block_size, sha256)
    limits = Limits(default=4, maximum=16, effort={}, policy="all")
    params = SamplingParams(extra_args={"num_steps": 8})
    salted = limits.salt(8, None, params.extra_args)

    def timed(act, inputs) -> float:
        """The median time of `act` on each of `inputs`, in µs."""
        times = []
        for item in inputs:
            start = time.perf_counter()
            act(item)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    def request(prompt: list[int], salt: str | None = None):
        return Request("r", prompt, params, None, cache_salt=salt, block_hasher=hasher)

    header = [
        "prompt tokens",
        "vLLM's hashing (µs)",
        "salt and rehash (µs)",
        "per token (µs)",
        "salted by the middleware (µs)",
    ]
    print(f"| {' | '.join(header)} |\n|{'---|' * len(header)}")
    for length in args.lengths:
        prompt, repeats = list(range(length)), range(args.repeats)
        first = timed(lambda salt: request(prompt, salt), [None for _ in repeats])  # noqa: B023 (called at once)
        rehash = timed(lambda made: salt_by_depth(made, limits), [request(prompt) for _ in repeats])
        kept = timed(lambda made: salt_by_depth(made, limits), [request(prompt, salted) for _ in repeats])
        print(f"| {length} | {first:.0f} | {rehash:.0f} | {rehash / length:.2f} | {kept:.1f} |")


if __name__ == "__main__":
    main()

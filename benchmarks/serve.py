"""Generation throughput through vLLM (eager and compiled) against recurfit's batched `generate`, in one run.

    .venv-vllm/bin/python benchmarks/serve.py [MODEL]      # default: the embedded SmolLM2 retrofitted to (4,8,4)
    .venv-vllm/bin/python benchmarks/serve.py RUN/final --device cuda --dtype bf16       # on a GPU

Needs vLLM (scripts/setup-vllm.sh). Two workloads, each at every r in `--depths`:

- uniform: `--prompts` prompts of `--prompt-length` tokens (English passages from embedded:prose), each
  `--new-tokens` greedy tokens, no stop;
- mixed traffic (`--mixed` requests): prompts of 8-256 tokens and budgets of 16-256 new tokens, drawn per request
  from a fixed seed, that also end at a stop sequence (`--stop`), the traffic where continuous batching matters.

recurfit's `generate` takes each workload as one left-padded batch with the `all` cache; in the mixed one a row
ends at its own budget or stop sequence, but the batch runs until its longest row is done. vLLM takes the same
requests through `vllm.LLM` on the saved folder with `hf_overrides={"mean_recurrence": r}`, once eager
(`enforce_eager=True`) and once in its default compiled mode (on a CPU: the prelude, one core step and the coda
compiled by inductor; on a GPU: compiled, with CUDA graphs), and schedules them itself. Prints the seconds and
tokens/s of each, recurfit's time over each vLLM mode's time (the ratio; > 1: vLLM is faster), each engine's load
and compile time (not counted), and how many rows came out identical to recurfit's.

With `--depth-mix N` (default 64; 0 leaves it out) it also serves a mixed-depth workload: N requests drawn as in
the mixed-traffic case (without the stop, so that every run makes the same tokens), each asking for its own
recurrence, drawn from `--mix-depths` (1, 2, 4, 16), through one engine (`max_recurrence` = the deepest) with
depth per request, against (a) the same engine serving every request at the deepest r, and (b) the FLOPs-ideal
ratio: Σ over requests of tokens × (P + R·r + C) layers at their own r, over the same sum with every r at the
deepest; and each depth's median time to first token (vLLM's per-request stats), in both runs.
`--depth-mix-modes` (default compiled, vLLM's default mode) chooses the engines: in either, the core runs each
step on the tokens still short of their depth.

With `--exit-requests N` (default 0: left out) it also serves adaptive exit: N prose passages, each a prompt of
`--exit-prompt-length` tokens and a reference of the `--exit-new-tokens` after it, through one compiled engine
(`max_recurrence` = `--exit-cap`), every request capped at that depth: once at the fixed depth (no rule), once per
rule of `--exit-rules` (vllm_xargs `exit`, `min_depth` the default 2), alternating for `--repeats` rounds. Each request
generates its reference (a logits processor leaves only the reference's next token; vLLM's log-probabilities are
read before it), so each run decodes the same tokens and their log-probabilities give the teacher-forced prose loss
at the depths exit chose. Prints each run's tokens/s, the fixed depth's time over each rule's, the loss and its
difference from the fixed depth's with their standard errors over the requests, the mean exit depth of the
generated tokens (the depths the served model recorded) and the FLOPs-ideal ratio (Σ tokens × (P + R·depth + C),
prompts at the cap). With `--exit-cost` each rule runs again with a threshold it never meets (`kl:-1`,
`state:-1`, `argmax:CAP+1`): every token runs to the cap with the criterion computed at every step, so the time
over the fixed depth's is the criterion's own cost. The exit workload runs in a process of its own with its engine
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), where `apply_model` reads the recorded depths.

With `--speculate` it also measures vLLM's speculative decoding with a draft folder (`recurfit draft`): a batch of
prose prompts, greedy, at each of `--speculate-depths` (the depth the model was trained at, then deeper) and batch
size (`--speculate-batches`): an engine serving that depth plainly, then one per draft depth (`--draft-depths`) and
number of speculative tokens (`--speculative-tokens`; at the later batch sizes only the fastest at the first), each
with its tokens/s over the plain engine's, its acceptance (vLLM's counters: accepted over drafted tokens) and how
many rows equal the plain engine's; beside them recurfit's `generate` with its own self-speculation
(`speculative_generate`, drafting at the smallest draft depth, as many drafts as pay) against its plain greedy
decoding. Engines are eager (`enforce_eager`) on both sides. `--speculate-up-to N` has vLLM draft only while a
step's batch holds at most N requests (its `num_speculative_tokens_per_batch_size`).

The machine is shared and noisy: after one recurfit pass per workload and r, `--repeats` rounds alternate the vLLM
engines and recurfit (one engine at a time, shut down before the next runs: an idle engine's worker keeps a core
busy), and the summary takes each side's fastest round. Without MODEL the untrained retrofit has s_0 = 0
(state_init_std 0), so the engines compute the same function and the rows can be compared. Each vLLM engine runs
in its own process (vLLM's default), so that its CPU worker's thread binding leaves recurfit's threads in this
process alone.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

# vLLM's CPU worker otherwise drops to one thread ("Reducing Torch threads ... for serving"); recurfit's torch
# takes the cores by default. Both get every core, through the environment the engine processes inherit.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import torch  # noqa: E402
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria  # noqa: E402

import recurfit  # noqa: E402
from recurfit.data.sources import embedded_prose  # noqa: E402
from recurfit.generation.speculative import speculative_generate  # noqa: E402
from recurfit.model.cache import RecurrentCache  # noqa: E402
from recurfit.model.compat import cache_kwargs  # noqa: E402
from recurfit.model.loading import load_model, load_tokenizer, save_tokenizer  # noqa: E402

DTYPES = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}
MODES = ("eager", "compiled")
MIXED_PROMPTS = (8, 256)  # prompt tokens, inclusive
MIXED_NEW_TOKENS = (16, 256)  # new-token budgets, inclusive


@dataclass
class Workload:
    """Requests: token ids, each one's new-token budget, and the stop sequences (none: every budget is spent)."""

    name: str
    prompts: list[list[int]]
    budgets: list[int]
    stop: list[str]

    @property
    def max_length(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.budgets))


def prose_tokens(tokenizer, count: int) -> list[int]:
    """The first `count` tokens of embedded:prose, its passages joined by blank lines."""
    tokens: list[int] = []
    separator = tokenizer("\n\n", add_special_tokens=False).input_ids
    for text in embedded_prose():
        tokens += tokenizer(text, add_special_tokens=False).input_ids + separator
        if len(tokens) >= count:
            return tokens[:count]
    raise SystemExit("embedded:prose holds fewer tokens than the prompts need")


def passages(tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of each of the first `count` embedded:prose passages that hold as many."""
    rows = []
    for text in embedded_prose():
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == count:
            return rows
    raise SystemExit("not enough passages of that length")


def uniform_workload(tokenizer, count: int, length: int, new_tokens: int) -> Workload:
    return Workload("uniform", passages(tokenizer, count, length), [new_tokens] * count, [])


def mixed_workload(tokenizer, count: int, stop: list[str], seed: int = 0) -> Workload:
    """`count` requests with prompt lengths and budgets drawn uniformly from MIXED_PROMPTS and MIXED_NEW_TOKENS,
    the prompts consecutive windows of embedded:prose."""
    draw = random.Random(seed)
    lengths = [draw.randint(*MIXED_PROMPTS) for _ in range(count)]
    budgets = [draw.randint(*MIXED_NEW_TOKENS) for _ in range(count)]
    stream = prose_tokens(tokenizer, sum(lengths))
    starts = [sum(lengths[:i]) for i in range(count)]
    return Workload("mixed", [stream[s : s + n] for s, n in zip(starts, lengths)], budgets, stop)


def model_folder(args, root: str) -> str:
    """MODEL, or the embedded SmolLM2 retrofitted to --shape with s_0 = 0 (or σ = --state-init-std), saved with its
    tokenizer."""
    if args.model:
        return args.model
    shape = tuple(int(x) for x in args.shape.split(","))
    model = recurfit.retrofit(load_model(None, dtype=torch.float32), shape, state_init_std=args.state_init_std)
    model.save_pretrained(root)
    save_tokenizer(load_tokenizer(None), root)
    return root


class RowBudgets(StoppingCriteria):
    """Ends each row of a left-padded batch once it has its own number of new tokens."""

    def __init__(self, budgets: list[int], prompt_width: int):
        self.budgets = torch.tensor(budgets)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width >= self.budgets).to(input_ids.device)


def trimmed(row: list[int], budget: int, stopped: bool, tokenizer, stop: list[str]) -> list[int]:
    """A batch row's own new tokens: up to its budget, or to the token that completed a stop sequence."""
    row = row[:budget]
    if stopped:
        for end in range(1, len(row) + 1):
            if any(s in tokenizer.decode(row[:end]) for s in stop):
                return row[:end]
    return row


def left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch (pad id 0) and its attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@torch.no_grad()
def recurfit_run(model, tokenizer, work: Workload, r: int, device) -> tuple[float, list[list[int]]]:
    width = max(map(len, work.prompts))
    ids, mask = left_padded(work.prompts, device)
    criteria = StoppingCriteriaList([RowBudgets(work.budgets, width)])
    if work.stop:
        criteria.append(StopStringCriteria(tokenizer, work.stop))
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max(work.budgets),
        do_sample=False,
        num_steps=r,
        eos_token_id=None,
        pad_token_id=0,
        stopping_criteria=criteria,
        **cache_kwargs(RecurrentCache(model.config)),
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    rows = out[:, width:].tolist()
    return seconds, [trimmed(row, n, bool(work.stop), tokenizer, work.stop) for row, n in zip(rows, work.budgets)]


def vllm_engine(folder, r: int, mode: str, max_length: int, args, max_recurrence: int | None = None, **engine_args):
    import vllm

    start = time.perf_counter()
    extra = {"kv_cache_memory_bytes": int(args.kv_cache_gib * (1 << 30))} if args.device == "cpu" else {}
    llm = vllm.LLM(
        folder,
        dtype=DTYPES[args.dtype][0],
        enforce_eager=mode == "eager",
        max_model_len=max_length,
        hf_overrides={"mean_recurrence": r, "max_recurrence": max_recurrence or r},
        seed=0,
        **extra,
        **engine_args,
    )
    return llm, time.perf_counter() - start


def vllm_run(llm, work: Workload, depths: list[int] | None = None) -> tuple[float, list[list[int]], list]:
    """The workload through `llm`; `depths`: each request's own recurrence (SamplingParams.extra_args; the engine
    salts each request's prefix cache by its depth). Returns the seconds, each request's tokens and its time to
    first token (None for an engine that keeps no per-request stats)."""
    import vllm

    params = [
        vllm.SamplingParams(
            temperature=0.0,
            max_tokens=n,
            stop=work.stop or None,
            ignore_eos=True,
            extra_args=None if depths is None else {"num_steps": depths[i]},
        )
        for i, n in enumerate(work.budgets)
    ]
    start = time.perf_counter()
    prompts = [{"prompt_token_ids": p} for p in work.prompts]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    first = [o.metrics.first_token_latency if o.metrics is not None else None for o in outputs]
    return seconds, [list(o.outputs[0].token_ids) for o in outputs], first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="a recurfit model folder (default: embedded retrofit, untrained)")
    parser.add_argument("--shape", default="4,8,4", help="the embedded parent's retrofit (without MODEL)")
    parser.add_argument("--prompts", type=int, default=64, help="uniform workload: requests (0: leave it out)")
    parser.add_argument("--prompt-length", type=int, default=32, help="uniform workload: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="uniform workload: new tokens per request")
    parser.add_argument("--mixed", type=int, default=64, help="mixed-traffic workload: requests (0: leave it out)")
    parser.add_argument("--stop", action="append", help="mixed workload's stop sequences (default: a blank line)")
    parser.add_argument("--depths", default="4,8")
    parser.add_argument("--modes", default=",".join(MODES), help="vLLM's: eager, compiled or both")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="vLLM's KV cache on a CPU, per engine")
    parser.add_argument("--repeats", type=int, default=1, help="rounds alternating vLLM and recurfit")
    parser.add_argument("--state-init-std", type=float, default=0.0, help="the embedded retrofit's σ (0: s_0 = 0)")
    parser.add_argument("--depth-mix", type=int, default=64, help="mixed-depth workload: requests (0: leave it out)")
    parser.add_argument("--mix-depths", default="1,2,4,16", help="mixed-depth workload: the depths drawn from")
    parser.add_argument(
        "--depth-mix-modes", default="compiled", help="mixed-depth workload: vLLM's eager, compiled or both"
    )
    parser.add_argument("--exit-requests", type=int, default=0, help="exit workload: requests (0: leave it out)")
    parser.add_argument("--exit-rules", default="kl:5e-4,state:0.01,argmax:2", help="exit workload: the rules")
    parser.add_argument("--exit-cap", type=int, default=32, help="exit workload: each request's depth (the cap)")
    # Short prompts, long answers: a prompt runs every step of the cap whatever the rule, so exit can only speed up
    # the generated tokens (at 32 + 48 tokens the prompts alone cap the FLOPs-ideal speed-up near 2x).
    parser.add_argument("--exit-prompt-length", type=int, default=16, help="exit workload: prompt tokens")
    parser.add_argument("--exit-new-tokens", type=int, default=128, help="exit workload: reference tokens generated")
    parser.add_argument("--exit-cost", action="store_true", help="exit workload: each rule's cost at the cap too")
    parser.add_argument("--speculate", action="store_true", help="measure speculative decoding (see above)")
    parser.add_argument("--speculate-depths", default="4,16,32", help="speculation: the served depths")
    parser.add_argument("--speculate-batches", default="1,16", help="speculation: requests served together")
    parser.add_argument("--speculate-new-tokens", type=int, default=48, help="speculation: new tokens per request")
    parser.add_argument("--draft-depths", default="1,2", help="speculation: the draft folders' depths")
    parser.add_argument("--speculative-tokens", default="2,4", help="speculation: tokens drafted per step")
    parser.add_argument(
        "--speculate-up-to",
        type=int,
        default=0,
        help="speculation: draft only in batches of at most this many requests (vLLM's "
        "num_speculative_tokens_per_batch_size; 0: in every batch)",
    )
    args = parser.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as root:
        folder = model_folder(args, root)
        tokenizer = load_tokenizer(folder)
        workloads = []
        if args.prompts:
            workloads.append(uniform_workload(tokenizer, args.prompts, args.prompt_length, args.new_tokens))
        if args.mixed:
            workloads.append(mixed_workload(tokenizer, args.mixed, args.stop or ["\n\n"]))
        model = load_model(folder, dtype=DTYPES[args.dtype][1], device=device)
        max_length = max((work.max_length for work in workloads), default=0)
        print(f"{folder}: {args.dtype} on {device}, torch threads {torch.get_num_threads()}")
        for work in workloads:
            prompt_tokens = sum(map(len, work.prompts))
            print(f"{work.name}: {len(work.prompts)} requests, {prompt_tokens} prompt tokens, budgets of "
                  f"{min(work.budgets)}-{max(work.budgets)} new tokens, stop {work.stop}")  # fmt: skip
        times = {}  # (workload, engine, r) -> seconds of each round
        rows = {}  # (workload, r) -> recurfit's rows

        def record(work: Workload, engine: str, r: int, seconds: float, produced: list[list[int]]) -> None:
            times.setdefault((work.name, engine, r), []).append(seconds)
            tokens = sum(map(len, produced))
            same = sum(a == b for a, b in zip(produced, rows[work.name, r]))
            ended = sum(len(row) < n for row, n in zip(produced, work.budgets))
            print(
                f"{work.name} r={r} {engine}: {tokens / seconds:.1f} tok/s ({tokens} tokens in {seconds:.1f} s, "
                f"{ended} rows ended at a stop, {same}/{len(produced)} rows identical to recurfit's)",
                flush=True,
            )

        def recurfit_round(r: int) -> None:
            for work in workloads:
                seconds, produced = recurfit_run(model, tokenizer, work, r, device)
                rows.setdefault((work.name, r), produced)
                record(work, "recurfit", r, seconds, produced)

        for r in depths if workloads else []:
            recurfit_round(r)
        for _ in range(args.repeats if workloads else 0):
            for r in depths:
                for mode in modes:
                    llm, loaded = vllm_engine(folder, r, mode, max_length, args)
                    print(f"r={r} vLLM {mode} engine loaded (and compiled) in {loaded:.1f} s", flush=True)
                    for work in workloads:
                        record(work, f"vLLM {mode}", r, *vllm_run(llm, work)[:2])
                    llm.llm_engine.engine_core.shutdown()  # an idle engine's worker still takes a core
                    del llm
                recurfit_round(r)
        if args.depth_mix:
            depth_mix(folder, tokenizer, args)
        if args.exit_requests:
            exit_workload(folder, tokenizer, args)
        if args.speculate:
            speculation(folder, tokenizer, model, root, args)
        for work in workloads:
            for r in depths:
                ours = min(times[work.name, "recurfit", r])
                ratios = ", ".join(
                    f"vLLM {mode} {min(times[work.name, f'vLLM {mode}', r]):.1f} s (ratio "
                    f"{ours / min(times[work.name, f'vLLM {mode}', r]):.2f}x)"
                    for mode in modes
                )
                print(f"summary {work.name} r={r}: recurfit {ours:.1f} s, {ratios} "
                      f"(fastest of {len(times[work.name, 'recurfit', r])} rounds)")  # fmt: skip


def depth_mix(folder, tokenizer, args) -> None:
    """For each of --depth-mix-modes, one engine: the mixed-depth workload with depth per request, and the same
    requests all at the deepest depth, alternating for --repeats rounds; the throughput ratio beside the FLOPs-ideal
    one, and each depth's median time to first token in both."""
    from recurfit.model.loading import load_config

    choices = [int(x) for x in args.mix_depths.split(",")]
    work = mixed_workload(tokenizer, args.depth_mix, [], seed=1)  # no stop: both runs make the same tokens
    work.name = "depth-mix"
    draw = random.Random(1)
    own = [draw.choice(choices) for _ in work.prompts]
    deepest = max(choices)
    P, R, C = load_config(folder).shape
    print(f"depth-mix: {len(own)} requests, depths {dict(sorted((r, own.count(r)) for r in set(own)))}")
    for mode in args.depth_mix_modes.split(","):
        llm, loaded = vllm_engine(folder, deepest, mode, work.max_length, args, deepest, disable_log_stats=False)
        print(f"depth-mix: vLLM {mode} engine (max_recurrence {deepest}) loaded in {loaded:.1f} s", flush=True)
        best: dict[str, float] = {}
        first_token: dict[str, list] = {}
        for _ in range(args.repeats):
            for name, depths in (("own depths", own), (f"all at r={deepest}", [deepest] * len(own))):
                seconds, produced, first = vllm_run(llm, work, depths)
                if seconds <= best.get(name, seconds):
                    first_token[name] = first
                tokens = sum(map(len, produced))
                best[name] = min(best.get(name, seconds), seconds)
                cost = sum((len(p) + len(row)) * (P + R * r + C) for p, row, r in zip(work.prompts, produced, depths))
                best[name + " cost"] = cost
                print(f"depth-mix {mode} {name}: {tokens / seconds:.1f} tok/s ({tokens} tokens in {seconds:.1f} s)",
                      flush=True)  # fmt: skip
        llm.llm_engine.engine_core.shutdown()
        del llm
        measured = best[f"all at r={deepest}"] / best["own depths"]
        ideal = best[f"all at r={deepest} cost"] / best["own depths cost"]
        print(f"summary depth-mix {mode}: own depths {best['own depths']:.1f} s, all at r={deepest} "
              f"{best[f'all at r={deepest}']:.1f} s: {measured:.2f}x faster (FLOPs-ideal {ideal:.2f}x)")  # fmt: skip
        for r in sorted(set(own)):
            medians = {
                name: statistics.median(first[i] for i, d in enumerate(own) if d == r)
                for name, first in first_token.items()
            }
            print(f"summary depth-mix {mode} time to first token, requests of r={r}: "
                  + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in medians.items()))  # fmt: skip


REFERENCE = "reference"  # the exit workload's extra_args key: the tokens a request is made to generate


def exit_workload(folder, tokenizer, args) -> None:
    """`served_exit` on --exit-requests passages, in a spawned process of its own (its engine in-process there)."""
    import multiprocessing

    length = args.exit_prompt_length
    rows = passages(tokenizer, args.exit_requests, length + args.exit_new_tokens)
    process = multiprocessing.get_context("spawn").Process(
        target=served_exit, args=(folder, [row[:length] for row in rows], [row[length:] for row in rows], args)
    )
    process.start()
    process.join()
    if process.exitcode:
        raise SystemExit(f"the exit workload failed (exit code {process.exitcode})")


def never_settling(rule: str, cap: int) -> str:
    """`rule`'s criterion with a threshold it never meets within `cap` steps (no change is below -1; no prediction
    holds for cap + 1 steps): computed at every step, while every token runs to the cap."""
    criterion = rule.partition(":")[0]
    return f"argmax:{cap + 1}" if criterion == "argmax" else f"{criterion}:-1"


def served_exit(folder, prompts: list[list[int]], references: list[list[int]], args) -> None:
    """The exit workload (see the module docstring): one compiled engine, the fixed depth and each rule alternating
    for --repeats rounds, then a summary per rule against the fixed depth."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: apply_model reads its model
    from recurfit.model.loading import load_config

    cap, rules = args.exit_cap, args.exit_rules.split(",")
    settings = {"fixed": None} | {rule: rule for rule in rules}
    if args.exit_cost:
        settings |= {f"{rule} never settling": never_settling(rule, cap) for rule in rules}
    max_length = max(len(p) + len(r) for p, r in zip(prompts, references))
    llm, loaded = vllm_engine(
        folder, cap, "compiled", max_length, args, cap, enable_prefix_caching=False,
        logits_processors=[reference_processor()],
    )  # fmt: skip
    print(f"exit: {len(prompts)} requests of {len(prompts[0])} + {len(references[0])} tokens, cap {cap}; vLLM "
          f"compiled engine loaded in {loaded:.1f} s", flush=True)  # fmt: skip
    for rule in settings.values():  # warm-up: each setting's paths once
        forced_run(llm, prompts[:2], [r[:4] for r in references[:2]], cap, rule)
    runs: dict[str, list] = {}  # name -> (seconds, per-request losses, per-request exit depths) of each round
    for _ in range(args.repeats):
        for name, rule in settings.items():
            seconds, losses, depths = forced_run(llm, prompts, references, cap, rule)
            runs.setdefault(name, []).append((seconds, losses, depths))
            tokens = sum(map(len, references))
            recorded = [d for row in depths for d in row]
            depth = f", mean exit depth {statistics.fmean(recorded):.2f}" if recorded else ""
            print(f"exit {name}: {tokens / seconds:.2f} tok/s ({tokens} tokens in {seconds:.1f} s), loss "
                  f"{statistics.fmean(losses):.4f}{depth}", flush=True)  # fmt: skip
    llm.llm_engine.engine_core.shutdown()
    del llm
    shape = load_config(folder).shape
    fixed_seconds, fixed_losses, _ = min(runs["fixed"])
    noise = statistics.stdev(fixed_losses) / len(fixed_losses) ** 0.5
    print(f"summary exit fixed r={cap}: {fixed_seconds:.1f} s, loss {statistics.fmean(fixed_losses):.4f} "
          f"(standard error over the requests {noise:.4f})")  # fmt: skip
    for name in list(settings)[1:]:
        seconds, losses, depths = min(runs[name])
        differences = [a - b for a, b in zip(losses, fixed_losses)]
        paired = statistics.stdev(differences) / len(differences) ** 0.5
        recorded = [d for row in depths for d in row]
        below = sum(d < cap for d in recorded) / len(recorded)
        print(f"summary exit {name}: {seconds:.1f} s, {fixed_seconds / seconds:.2f}x the fixed depth's throughput "
              f"(FLOPs-ideal {ideal_ratio(shape, cap, prompts, references, depths):.2f}x), loss "
              f"{statistics.fmean(losses):.4f} ({statistics.fmean(differences):+.4f} ± {paired:.4f} against the "
              f"fixed depth, paired standard error), mean exit depth {statistics.fmean(recorded):.2f} of "
              f"{len(recorded)} tokens ({below:.0%} below the cap)")  # fmt: skip


def ideal_ratio(shape, cap: int, prompts, references, depths) -> float:
    """Σ tokens × (P + R·depth + C) at the cap over the same at the exit depths: the prompts and each request's first
    generated token (read from the prompt) run at the cap; each later token at its recorded depth."""
    P, R, C = shape
    at_cap = sum(len(p) + len(r) - 1 for p, r in zip(prompts, references)) * (P + R * cap + C)
    fixed = sum(len(p) for p in prompts) * (P + R * cap + C)
    return at_cap / (fixed + sum(P + R * d + C for row in depths for d in row))


def forced_run(llm, prompts, references, cap: int, rule: str | None) -> tuple[float, list[float], list[list[int]]]:
    """Each prompt generates its reference at cap `cap` with exit `rule` (None: none): the seconds, each request's
    mean loss over its reference tokens (vLLM's log-probabilities, read before the reference processor), and the
    exit depths the model recorded for each request's generated tokens."""
    import vllm

    extra = {"num_steps": cap} | ({"exit": rule} if rule else {})
    params = [
        vllm.SamplingParams(
            temperature=0.0, max_tokens=len(ref), ignore_eos=True, logprobs=0, extra_args={**extra, REFERENCE: ref}
        )
        for ref in references
    ]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    losses = []
    for output, ref in zip(outputs, references):
        made = output.outputs[0]
        if list(made.token_ids) != ref:
            raise SystemExit(f"exit workload: a request generated {list(made.token_ids)}, not its reference {ref}")
        losses.append(-statistics.fmean(step[token].logprob for step, token in zip(made.logprobs, ref)))
    (record,) = llm.apply_model(taken_exit_depths)
    return seconds, losses, [record.get(tuple(p), []) for p in prompts]


def taken_exit_depths(model) -> dict:
    """The exit depths the served model recorded since the last call, by prompt (then forgotten)."""
    from recurfit.serving.depth import table_for

    record = table_for(model.vllm_config).exits.record
    taken = dict(record)
    record.clear()
    return taken


def reference_processor():
    """A vLLM logits processor that leaves each request with a `reference` in its extra_args only that reference's
    next token: the request generates its reference, and vLLM's (raw) log-probabilities, taken before logits
    processors run, are the model's own."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ReferenceTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            reference = (params.extra_args or {}).get(REFERENCE)
            if reference is None:
                return None

            def only_next(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                forced = torch.full_like(logits, float("-inf"))
                forced[reference[len(output_ids)]] = 0.0
                return forced

            return only_next

    return ReferenceTokens


def speculation(folder, tokenizer, model, root: str, args) -> None:
    """vLLM's `draft_model` speculation with recurfit's draft folders against the same engine without it, and
    recurfit's own self-speculation against its plain greedy decoding, at each served depth and batch size."""
    from recurfit.serving.draft import write_draft

    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    batches, drafts, lookaheads = ints(args.speculate_batches), ints(args.draft_depths), ints(args.speculative_tokens)
    folders = {d: str(write_draft(folder, d, os.path.join(root, f"draft-r{d}"))) for d in drafts}
    work = uniform_workload(tokenizer, max(batches), args.prompt_length, args.speculate_new_tokens)
    for r in ints(args.speculate_depths):
        settings = [(d, k) for d in drafts for k in lookaheads if d < r]  # the first batch size tries every one,
        for batch in batches:  # the others the fastest of those
            sub = Workload(f"speculate-b{batch}", work.prompts[:batch], work.budgets[:batch], [])
            plain, plain_rows, _ = engine_throughput(folder, r, sub, args)
            print(f"summary speculation r={r} batch {batch}: vLLM plain {plain:.1f} tok/s", flush=True)
            speeds = {}
            for d, k in settings:
                config = {"method": "draft_model", "model": folders[d], "num_speculative_tokens": k}
                if args.speculate_up_to:  # vLLM's own schedule: no drafts in larger batches
                    limit = args.speculate_up_to
                    config["num_speculative_tokens_per_batch_size"] = [[1, limit, k], [limit + 1, 1 << 16, 0]]
                speed, rows, counts = engine_throughput(folder, r, sub, args, speculative_config=config)
                accepted = counts["vllm:spec_decode_num_accepted_tokens"] / max(
                    counts["vllm:spec_decode_num_draft_tokens"], 1
                )
                same = sum(a == b for a, b in zip(rows, plain_rows))
                speeds[d, k] = speed
                print(f"summary speculation r={r} batch {batch}: vLLM draft r={d} k={k} {speed:.1f} tok/s "
                      f"({speed / plain:.2f}x plain), acceptance {accepted:.0%}, {same}/{batch} rows identical",
                      flush=True)  # fmt: skip
            ours = self_speculation(model, sub, r, min(drafts), max(lookaheads), args)
            print(f"summary speculation r={r} batch {batch}: recurfit generate {ours}", flush=True)
            settings = [max(speeds, key=speeds.get)] if speeds else []


def engine_throughput(folder, r: int, work: Workload, args, **engine_args) -> tuple[float, list[list[int]], dict]:
    """Tokens/s of an eager engine serving `work` at depth `r` (the fastest of --repeats runs after a warm-up
    request), its rows, and vLLM's counters."""
    llm, _ = vllm_engine(folder, r, "eager", work.max_length, args, disable_log_stats=False, **engine_args)
    vllm_run(llm, Workload("warm-up", work.prompts[:1], [4], []))
    best, rows = None, None
    for _ in range(args.repeats):
        seconds, rows, _ = vllm_run(llm, work)
        best = seconds if best is None else min(best, seconds)
    counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    llm.llm_engine.engine_core.shutdown()
    del llm
    return sum(map(len, rows)) / best, rows, counts


@torch.no_grad()
def self_speculation(model, work: Workload, r: int, draft: int, lookahead: int, args) -> str:
    """recurfit's plain greedy decoding and `speculative_generate` (adaptive drafts) on `work`, one batch."""
    width = max(map(len, work.prompts))
    ids, mask = left_padded(work.prompts, model.device)
    n = max(work.budgets)
    speculative_generate(model, ids, mask, max_new_tokens=2, num_steps=r, draft_steps=draft)  # warm-up
    start = time.perf_counter()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, num_steps=r,
                           eos_token_id=None, pad_token_id=0, **cache_kwargs(RecurrentCache(model.config)))  # fmt: skip
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    spec = speculative_generate(model, ids, mask, max_new_tokens=n, num_steps=r, draft_steps=draft, lookahead=lookahead)
    spec_seconds = time.perf_counter() - start
    same = sum(a == b for a, b in zip(plain[:, width:].tolist(), spec.sequences[:, width:].tolist()))
    tokens = n * len(work.prompts)
    return (f"plain {tokens / plain_seconds:.1f} tok/s, self-speculative (draft r={draft}, up to {lookahead}) "
            f"{tokens / spec_seconds:.1f} tok/s ({plain_seconds / spec_seconds:.2f}x), acceptance "
            f"{spec.acceptance_rate:.0%}, {same}/{len(work.prompts)} rows identical")  # fmt: skip


if __name__ == "__main__":
    main()

"""The healing study (docs/results/healing.md): which way of training a fresh retrofit closes the gap to its parent
fastest per FLOP.

Every arm trains the same retrofit of `--recipe` (default: recipes/smollm2-cpu.yaml, the embedded SmolLM2-135M
at (4, 8, 4)) on the same tokens for the same steps, changing one thing; the parent itself is trained as well, at
each arm's learning rates (a parent line per rate). The study runs in two stages, so that a partial run already
answers the main questions:

1. every arm, every seed (arm by arm, in ARMS's order): train; evaluate the snapshots and the final model at the
   mean recurrence (validation loss on the recipe's stores); measure the final model's teacher-forced exit depth
   on the math validation rows (`--exit kl:5e-4`'s rule); then delete the run's snapshots and checkpoints
   (`--keep-snapshots` keeps them); the report is rewritten after each;
2. the first seed's final models: the loss over r = 1…32, and the exit depth of `generate --exit kl:5e-4`
   through the cache (greedy tokens after prefixes of the math validation rows) beside the teacher-forced depth
   of the same tokens; then the figures.

Everything is written under `--out`, each stage skipped once its output exists (an interrupted study continues;
an interrupted training run resumes from its checkpoint):

    OUT/runs/ARM-sSEED/          the training runs (final/ kept)
    OUT/eval/ARM-sSEED-STORE/    evaluations over training, at the mean recurrence
    OUT/eval/ARM-s0-STORE-by-r/  the first seed's final model over r = 1…32
    OUT/exits/ARM-sSEED.json     teacher-forced exit depth on math (mean depth, loss at exit and at 16)
    OUT/exits/ARM-s0-cached.json the exit depth through the cache of generation, and teacher-forced on its tokens
    OUT/figures/                 loss over training FLOPs (teacher forwards included) and against r, first seed
    OUT/results.json, report.md  mean ± standard deviation over seeds, gap closed, verdicts

    .venv/bin/python scripts/healing_study.py [--out runs/healing] [--seeds 0,1,2] [--arms ce-identity,distill]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from recurfit.cli import main as recurfit
from recurfit.evaluate.loss import batches, load_examples
from recurfit.evaluate.over_training import RunEvaluation
from recurfit.generation import ExitRule
from recurfit.model.cache import RecurrentCache
from recurfit.model.compat import cache_kwargs
from recurfit.model.loading import load_model
from recurfit.train.metrics import read_log

REPO = Path(__file__).resolve().parents[1]
# Every arm starts from the paper's learning rates (the CPU recipe's until this study moved it to 5 times them).
PAPER_RATES = ["optimizer.muon_lr=1e-3", "optimizer.lr=5e-5"]
RATES_5X = ["optimizer.muon_lr=5e-3", "optimizer.lr=2.5e-4"]  # Muon at 5 times the paper's rates
ADAMW = ["optimizer.name=adamw", "optimizer.lr=5e-4"]  # LoRA's optimizer, on every part
PARENT = ["model.shape=null"]  # the parent itself, trained on the same tokens: what training alone gives
TORCH_DEFAULT = "model.adapter_init=torch-default"  # the paper authors' adapter start: nn.Linear's random draw
# Each arm's overrides of the recipe (after PAPER_RATES), in the order the study runs them: the main questions
# first (the rates, their parent lines, depth supervision where depths differ), then the other tools.
# `adapter-then-all` is two chained runs (see `train`).
ARMS = {
    "ce-identity": [],  # plain next-token loss from the [0 | I] adapter (the pruned parent): the reference
    "ce-muon-5x": RATES_5X,
    "parent": PARENT,  # the parent line of the paper's rates
    "parent-5x": [*PARENT, *RATES_5X],  # ... of ce-muon-5x's
    "ce-torch-default": [TORCH_DEFAULT],
    # The loss after every recurrence with gradient, from the random adapter start, where the readouts differ.
    # (From the [0 | I] start the readouts past r = 2 are equal: its supervised loss equalled plain cross-entropy
    # to 2e-6 at every step, so it measured nothing, and is not run.)
    "depth-supervision-torch-default": [TORCH_DEFAULT, "depth.supervise.weighting=uniform"],
    "adapter-then-all": [],  # the adapter alone, then everything: one run's schedule in two runs (see `train`)
    "distill": ["distill.alpha=0.5", "distill.temperature=2.0"],  # KL to the parent's next-token distribution
    "ce-adamw": ADAMW,  # every part under LoRA's optimizer: the control
    "lora": [  # rank-16 LoRA on every kept layer, the adapter trained fully; AdamW (LoRA does not take Muon)
        *ADAMW,
        "model.trainable=[adapter]",
        "lora.rank=16",
        "lora.alpha=32",
        "lora.parts=[prelude,core,coda]",
    ],
    "parent-adamw": [*PARENT, *ADAMW],  # ... of ce-adamw's and lora's
}
REFERENCE = "ce-identity"
# The comparisons the report draws a verdict on: (arm, the arm it is compared with). Every arm against the
# reference, and the pairs that change one more thing.
COMPARISONS = [
    *((arm, REFERENCE) for arm in ARMS if arm != REFERENCE and not arm.startswith("parent")),
    ("depth-supervision-torch-default", "ce-torch-default"),
    ("ce-adamw", "ce-muon-5x"),
    ("lora", "ce-adamw"),
]
# An arm is given a verdict only with at least this many seeds (fewer: labelled, no verdict).
VERDICT_SEEDS = 3
# A verdict: A and B differ when |mean_A − mean_B| > VERDICT_SIGMAS · √(s_A²/n_A + s_B²/n_B), s the standard
# deviation over seeds; otherwise "no difference shown".
VERDICT_SIGMAS = 2.0
# adapter-then-all: the adapter alone for the first quarter of the steps, then everything, from its result. The
# two runs are one run (`stop_at`, `model.continue_schedule`): the second goes on with the first one's data, step
# count, LR schedule, curricula and depth draws, so the arm reads the same rows as every other arm.
ADAPTER_SHARE = 0.25
EXIT_THRESHOLD, EXIT_MIN_STEPS, EXIT_MAX = 5e-4, 2, 16
CURVE_RECURRENCES = "1,2,4,8,16,32"
# Exit depth through the cache: greedy tokens after the first PROMPT_TOKENS tokens of the first PROMPTS math
# validation rows, with `generate --exit kl:5e-4 -r 16` (the cache policy `all`, generate's default).
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 4, 64, 32


def run(argv: list[str]) -> None:
    print("$ recurfit " + " ".join(map(str, argv)), flush=True)
    if recurfit([str(a) for a in argv]) != 0:
        sys.exit(f"recurfit {argv[0]} failed")


def train(recipe: Path, out: Path, arm: str, seed: int, steps: int, every: int) -> Path:
    """The arm's run (for adapter-then-all the second, chained run); trained unless it finished before, resumed
    from its last checkpoint if it was stopped."""
    common = [f"seed={seed}", f"steps={steps}", f"snapshots.every={every}", "eval.every=0", *PAPER_RATES]
    folder = out / "runs" / f"{arm}-s{seed}"
    if arm == "adapter-then-all":
        first_steps = min(max(1, round(steps * ADAPTER_SHARE)), steps - 1)
        first = out / "runs" / f"{arm}-s{seed}-adapter"
        chained = [f"model.init_from={first}", "model.continue_schedule=true", "model.shape=null", "model.path=null"]
        _check_chained(first, ("stop_at",), first_steps)
        _check_chained(folder, ("model", "continue_schedule"), True)
        if not (first / "final").is_dir():
            run(["train", recipe, "--out", first, "--resume", *common, f"stop_at={first_steps}",
                 "model.trainable=[adapter]"])  # fmt: skip
        if not (folder / "final").is_dir():  # the model comes from the first run's final/ folder
            run(["train", recipe, "--out", folder, "--resume", *common, *chained])
        return folder
    if not (folder / "final").is_dir():
        run(["train", recipe, "--out", folder, "--resume", *common, *ARMS[arm]])
    return folder


def prune(folder: Path) -> None:
    """Delete a finished and evaluated run's snapshots and checkpoints (and, for adapter-then-all, its first
    run's): the evaluations hold what the study reads of them, final/ stays (about 0.4 GB a run instead of 2)."""
    if not (folder / "final").is_dir():
        return
    for run_folder in (folder, folder.with_name(f"{folder.name}-adapter")):
        for name in ("snapshots", "checkpoints"):
            if (run_folder / name).is_dir():
                shutil.rmtree(run_folder / name)


def _check_chained(folder: Path, key: tuple[str, ...], expected) -> None:
    """Stop on an adapter-then-all run trained before the two runs were one (2026-11-24: the second restarted
    the data, schedule and curriculum): it would be skipped as done, and its numbers are not comparable."""
    settings = folder / "config.yaml"
    if not settings.is_file():
        return
    value = yaml.safe_load(settings.read_text())
    for name in key:
        value = (value or {}).get(name)
    if value != expected:
        sys.exit(
            f"{folder} was trained as a chain that restarts its schedule ({'.'.join(key)}: {value}, not {expected}); "
            f"delete it and its evaluations ({folder.parent.parent / 'eval'}/{folder.name}-*), or use another --out."
        )


def evaluate(run_folder: Path, out: Path, store: str, baseline: str, rows: int, sweep: bool = False) -> Path:
    """Validation loss on `store` (continues an interrupted evaluation): the snapshots and the final model at the
    run's mean recurrence; with `sweep`, the final model alone at each of CURVE_RECURRENCES (and the mean)."""
    final = json.loads((run_folder / "final" / "training.json").read_text())
    suffix, chosen = "", ["-r", final.get("mean_recurrence") or 1]
    if sweep:
        suffix, chosen = "-by-r", ["--steps", final["step"], "-r", CURVE_RECURRENCES]
    target = out / "eval" / f"{run_folder.name}-{Path(store).name}{suffix}"
    run(["eval", "loss", run_folder, "--data", store, "--limit", rows, *chosen,
         "--baseline", baseline, "--out", target])  # fmt: skip
    return target


@torch.no_grad()
def _readout_log_probs(model, ids: torch.Tensor, generator: torch.Generator):
    """Per position of `ids` [rows, T]: the depth at which the `--exit kl:5e-4` rule stops teacher-forced (the first
    step from EXIT_MIN_STEPS on where KL(p_s ‖ p_{s-1}) < EXIT_THRESHOLD, else EXIT_MAX), and the log-probabilities
    of the next token at every step [step, rows, T-1]."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    depth = torch.full(targets.shape, EXIT_MAX)
    target_log_p, previous = [], None
    for step, hidden in model.model.final_hidden_states_at(inputs, range(1, EXIT_MAX + 1), generator=generator):
        log_p = F.log_softmax(model.lm_head(hidden).float(), dim=-1)
        target_log_p.append(log_p.gather(-1, targets[..., None])[..., 0])
        if previous is not None and step >= EXIT_MIN_STEPS:
            settled = (log_p.exp() * (log_p - previous)).sum(-1) < EXIT_THRESHOLD
            depth = torch.where((depth == EXIT_MAX) & settled, torch.full_like(depth, step), depth)
        previous = log_p
    return depth, torch.stack(target_log_p)


@torch.no_grad()
def exit_depths(model_folder: Path, store: str, rows: int, chunk: int = 4) -> dict:
    """Teacher-forced adaptive depth on `store`'s validation rows: every earlier token is read at full depth, not
    through the cache of the steps it ran as `generate --exit` reads it (`cached_exit_depths` measures that).
    Returns the mean depth, and the loss at the exit depths against the loss at EXIT_MAX (equal quality?)."""
    model = load_model(str(model_folder), dtype=torch.float32).eval()
    if not hasattr(model.model, "final_hidden_states_at"):
        return {}
    ids, _ = next(batches(load_examples(store, limit=rows), rows))
    depths, at_exit, full = [], [], []
    generator = torch.Generator().manual_seed(0)
    for batch in ids.split(chunk):
        depth, by_step = _readout_log_probs(model, batch, generator)  # by_step: [step, row, position]
        depths.append(depth.flatten().float())
        at_exit.append(-by_step.gather(0, depth[None] - 1)[0].flatten())
        full.append(-by_step[-1].flatten())
    depth, at_exit, full = torch.cat(depths), torch.cat(at_exit), torch.cat(full)
    return {"mean_depth": depth.mean().item(), "loss_at_exit": at_exit.mean().item(), "loss_full": full.mean().item()}


@torch.no_grad()
def cached_exit_depths(model_folder: Path, store: str) -> dict:
    """The exit depth of generation: NEW_TOKENS greedy tokens after the first PROMPT_TOKENS tokens of each of the
    first PROMPTS rows of `store`, as `generate --exit kl:5e-4 -r 16` makes them (the cache policy `all`: a token
    that exited early is read at deeper steps through its latest computed step), the first token (the prompt's
    forward, all steps) left out. Beside it, the teacher-forced depth of the same tokens (every earlier token read
    at full depth), the study's measure."""
    model = load_model(str(model_folder), dtype=torch.float32).eval()
    if not hasattr(model.model, "final_hidden_states_at"):
        return {}
    rule = ExitRule.parse(f"kl:{EXIT_THRESHOLD}", min_steps=EXIT_MIN_STEPS)
    prompts = next(batches(load_examples(store, limit=PROMPTS), PROMPTS))[0][:, :PROMPT_TOKENS]
    cached, forced = [], []
    for prompt in prompts:
        torch.manual_seed(0)
        output = model.generate(
            prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0, return_dict_in_generate=True, num_steps=EXIT_MAX, exit_rule=rule,
            **cache_kwargs(RecurrentCache(model.config, policy="all")),
        )  # fmt: skip
        length = prompt.shape[0]  # PROMPT_TOKENS, or the whole row if it is shorter
        new = output.sequences.shape[1] - length
        # The first token comes from the prompt's forward, which runs all its steps (docs/how-to/generation.md): the
        # decoded ones after it are measured. Token i of the answer is predicted at position length − 1 + i.
        cached += output["steps_per_token"][0, 1:new].tolist()
        depth, _ = _readout_log_probs(model, output.sequences, torch.Generator().manual_seed(0))
        forced += depth[0, length : length - 1 + new].tolist()
    if not cached:  # every answer ended at its first token
        return {"tokens": 0}
    return {
        "tokens": len(cached),
        "mean_depth_cached": statistics.mean(cached),
        "mean_depth_teacher_forced": statistics.mean(forced),
    }


def measured(path: Path, measure, *args) -> dict:
    """`measure(*args)`, kept in `path` so that a continued study does not measure it again."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measure(*args), indent=2) + "\n")
    return json.loads(path.read_text())


def summarise(folder: Path, evaluations: dict[str, Path], exits: dict) -> dict:
    """One run's numbers: training FLOPs (teacher included), time, final losses at r̄, start loss, exit depth, and
    with depth supervision how far the supervised readouts' loss is from the final one's (0: they are equal)."""
    final = json.loads((folder / "final" / "training.json").read_text())
    # adapter-then-all: the first, adapter-only run's compute counts too. Its second run continues the first's
    # counters (model.continue_schedule), so `earlier` adds only what preceded the chain (nothing here); the
    # first run's steps are timed in its own log.
    earlier = final.get("earlier") or {}
    flops = sum(record.get(key, 0.0) for record in (final, earlier) for key in ("flops_paper", "flops_teacher"))
    logs = [folder.parent / name for name in earlier.get("runs", []) if (folder.parent / name).is_dir()] + [folder]
    records = [r for log in logs for r in read_log(log) if r["kind"] == "train"]
    row = {"flops": flops, "seconds": sum(r["seconds"] for r in records), **exits}
    supervised = [r["ce_supervised"] - r["ce"] for r in records if "ce_supervised" in r]
    if supervised:
        row["supervised_minus_final_ce"] = statistics.mean(supervised)
    for store, path in evaluations.items():
        evaluation = RunEvaluation.load(path)
        row[f"{store}_final"] = evaluation.curve_row(evaluation.final).metrics["loss"]
        row[f"{store}_start"] = evaluation.curve_row(evaluation.sweeps[0]).metrics["loss"]
        row[f"{store}_parent"] = evaluation.final.parent.metrics["loss"] if evaluation.final.parent else None
    return row


def add_sweep(row: dict, sweeps: dict[str, Path], cached: dict) -> None:
    """The first seed's extras: the final model's loss at each r, and the exit depth through the cache."""
    for store, path in sweeps.items():
        final = RunEvaluation.load(path).final
        row[f"{store}_by_r"] = {str(r.steps): r.metrics["loss"] for r in final.rows}
    row.update(cached)


def parent_line(arm: str) -> str | None:
    """The parent arm trained at `arm`'s optimizer and rates (the overrides under `optimizer.`), None if none is."""
    rates = sorted(o for o in ARMS.get(arm, []) if o.startswith("optimizer."))
    return next(
        (
            p
            for p in ARMS
            if p.startswith("parent") and sorted(o for o in ARMS[p] if o.startswith("optimizer.")) == rates
        ),
        None,
    )


def _mean_sd(values: list[float], digits: int = 3) -> str:
    if not values:
        return "–"
    text = f"{statistics.mean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def report(results: dict[str, dict[int, dict]], stores: list[str], minutes: float) -> str:
    """The tables of docs/results/healing.md: mean ± standard deviation over seeds, the share of the gap to the parent
    trained at the same rates that training closed, exit depths, and the verdicts."""
    lines = [
        f"Time of this invocation of the study (stages done before are skipped): {minutes:.1f} minutes.",
        "",
        "Mean ± standard deviation over seeds (sample, n − 1). Gap closed: (start − final) / (start − parent line), "
        "start the fresh [0 | I] retrofit, parent line the parent trained on the same rows at the arm's rates "
        "(same seed); the parent lines are themselves 100 %. Arms with fewer than "
        f"{VERDICT_SEEDS} seeds are marked † and get no verdict.",
        "",
    ]
    header = ["arm", "seeds", "parent line", "training TFLOPs (incl. teacher)"]
    for store in stores:
        header += [f"{store} loss", f"{store} gap closed"]
    header += ["exit depth, teacher-forced (math)", "loss at exit − at r=16", "exit depth through the cache (seed 0)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, by_seed in results.items():
        seeds = sorted(by_seed)
        line = parent_line(arm)
        label = arm + (" †" if len(seeds) < VERDICT_SEEDS else "")
        flops = statistics.mean(r["flops"] for r in by_seed.values()) / 1e12
        cells = [label, ",".join(map(str, seeds)), "(itself)" if line == arm else line or "–", f"{flops:.1f}"]
        for store in stores:
            cells.append(_mean_sd([by_seed[s][f"{store}_final"] for s in seeds]))
            closed = [_gap_closed(by_seed[s], results, line, s, store) for s in seeds]
            closed = [100 * c for c in closed if c is not None]
            cells.append(_mean_sd(closed, 0) + " %" if closed else "–")
        exits = [by_seed[s] for s in seeds if "mean_depth" in by_seed[s]]
        cells.append(_mean_sd([e["mean_depth"] for e in exits], 2))
        cells.append(_mean_sd([e["loss_at_exit"] - e["loss_full"] for e in exits], 4))
        first = by_seed[seeds[0]]
        cached = (first.get("mean_depth_cached"), first.get("mean_depth_teacher_forced"))
        cells.append(f"{cached[0]:.2f} (teacher-forced on its tokens: {cached[1]:.2f})" if cached[0] else "–")
        lines.append("| " + " | ".join(cells) + " |")
    supervised = {
        arm: [r["supervised_minus_final_ce"] for r in by_seed.values() if "supervised_minus_final_ce" in r]
        for arm, by_seed in results.items()
    }
    for arm, values in supervised.items():
        if values:
            lines += ["", f"{arm}: supervised loss − final cross-entropy, mean over steps: {_mean_sd(values, 4)} nats "
                      "(0 would mean the supervised readouts are equal)."]  # fmt: skip
    lines += ["", verdicts(results, stores)]
    return "\n".join(lines) + "\n"


def _gap_closed(row: dict, results: dict, line: str | None, seed: int, store: str) -> float | None:
    """The share of the fresh retrofit's gap to the parent line that training closed: (start − final) /
    (start − parent line's final), the start being the reference arm's step-0 retrofit of the same seed (the fresh
    [0 | I] retrofit: the parent lines and the random adapter start have none of their own)."""
    start = results.get(REFERENCE, {}).get(seed, {}).get(f"{store}_start")
    parent = results.get(line, {}).get(seed, {}).get(f"{store}_final") if line else None
    if start is None or parent is None or start <= parent:
        return None
    return (start - row[f"{store}_final"]) / (start - parent)


def verdicts(results: dict[str, dict[int, dict]], stores: list[str]) -> str:
    """The verdict rule: A's final loss differs from B's when |mean_A − mean_B| > 2·√(s_A²/n_A + s_B²/n_B) (s the
    standard deviation over seeds, n the seeds), else "no difference shown"; only with VERDICT_SEEDS seeds each."""
    lines = [
        f"Verdicts: A differs from B when |mean_A − mean_B| > {VERDICT_SIGMAS:g}·√(s_A²/n_A + s_B²/n_B), s the "
        f"standard deviation over seeds and n their number (at least {VERDICT_SEEDS} each); otherwise no difference "
        "shown.",
        "",
    ]
    for store in stores:
        for arm, other in COMPARISONS:
            if arm not in results or other not in results:
                continue
            a = [r[f"{store}_final"] for r in results[arm].values()]
            b = [r[f"{store}_final"] for r in results[other].values()]
            if min(len(a), len(b)) < VERDICT_SEEDS:
                lines.append(f"- {store}: {arm} against {other}: no verdict ({len(a)} and {len(b)} seeds)")
                continue
            difference = statistics.mean(a) - statistics.mean(b)
            bound = VERDICT_SIGMAS * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
            verdict = "no difference shown" if abs(difference) <= bound else ("lower" if difference < 0 else "higher")
            lines.append(f"- {store}: {arm} − {other} = {difference:+.3f} nats (bound {bound:.3f}): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-cpu.yaml")
    parser.add_argument("--out", type=Path, default=Path("runs/healing"))
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms, run in this order (default: all)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per arm (default: the recipe's 20)")
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16, help="validation rows per store (default 16)")
    parser.add_argument("--baseline", default="embedded", help="the untrained parent (default: embedded)")
    parser.add_argument("--keep-snapshots", action="store_true", help="keep each run's snapshots and checkpoints")
    args = parser.parse_args(argv)
    started = time.monotonic()
    recipe = yaml.safe_load(args.recipe.read_text())
    stores = recipe["data"]["validation"]
    names = [Path(store).name for store in stores]
    math_store = next((s for s in stores if Path(s).name == "math"), stores[0])
    _prepare_data(recipe)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        sys.exit(f"--arms: unknown {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    results: dict[str, dict[int, dict]] = {}

    def write_report() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "report.md").write_text(report(results, names, (time.monotonic() - started) / 60))

    # 1. Every arm and seed at the mean recurrence: the verdicts need nothing more.
    for arm in arms:
        for seed in seeds:
            folder = train(args.recipe, args.out, arm, seed, args.steps, args.snapshot_every)
            evaluations = {
                name: evaluate(folder, args.out, store, args.baseline, args.rows) for name, store in zip(names, stores)
            }
            exits = measured(
                args.out / "exits" / f"{folder.name}.json", exit_depths, folder / "final", math_store, args.rows
            )
            if not args.keep_snapshots:
                prune(folder)
            results.setdefault(arm, {})[seed] = summarise(folder, evaluations, exits)
            write_report()
    # 2. The first seed's final models over r, and their exit depth through the cache.
    for arm in arms:
        folder = args.out / "runs" / f"{arm}-s{seeds[0]}"
        recurrent = "mean_depth" in results[arm][seeds[0]]
        sweeps = {
            name: evaluate(folder, args.out, store, args.baseline, args.rows, sweep=True)
            for name, store in zip(names, stores)
            if recurrent
        }
        cached = measured(
            args.out / "exits" / f"{folder.name}-cached.json", cached_exit_depths, folder / "final", math_store
        )
        add_sweep(results[arm][seeds[0]], sweeps, cached)
        write_report()
    for name in names:  # per store, the first seed's runs: all of them, and all but the random adapter start's
        over_training = {arm: args.out / "eval" / f"{arm}-s{seeds[0]}-{name}" for arm in arms}
        by_r = {
            arm: path.with_name(path.name + "-by-r") if path.with_name(path.name + "-by-r").is_dir() else path
            for arm, path in over_training.items()
        }
        for figures, evaluations in ((name, over_training), (f"{name}-by-r", by_r)):
            run(["plot", *evaluations.values(), "--out", args.out / "figures" / figures])
            near = [path for arm, path in evaluations.items() if TORCH_DEFAULT not in ARMS[arm]]  # nats above
            run(["plot", *near, "--out", args.out / "figures" / f"{figures}-without-random-adapter"])
    write_report()
    print((args.out / "report.md").read_text())


def _prepare_data(recipe: dict) -> None:
    """The default recipe's stores, as its header prepares them (a recipe with its own stores brings them)."""
    for store in recipe["data"]["validation"]:
        if not Path(store).is_dir() and store in ("data/prose", "data/math"):
            source = "embedded:prose" if store.endswith("prose") else "embedded:math:4000"
            run(["data", "prepare", "--source", source, "--seq-len", "256", "--out", store])


if __name__ == "__main__":
    main()

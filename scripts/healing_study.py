"""The healing study (docs/healing.md): which way of training a fresh retrofit closes the gap to its parent
fastest per FLOP.

Every arm trains the same retrofit of `--recipe` (default: recipes/smollm2-cpu.yaml, the embedded SmolLM2-135M
at (4, 8, 4)) on the same tokens for the same steps, changing one thing; the parent itself is trained as well.
Each run saves snapshots; each is evaluated over training (validation loss on the recipe's stores, at its mean
recurrence, and the final model over r = 1…32); and the final models' per-token exit depth is measured with
`--exit kl:5e-4`'s rule on the math validation rows, teacher-forced. Everything is written under `--out`, each
stage skipped once its output exists (an interrupted study continues):

    OUT/runs/ARM-sSEED/        the training runs            OUT/eval/ARM-sSEED-STORE/   evaluations over training
    OUT/exits/ARM-sSEED.json   the final model's teacher-forced exit depth on math (mean depth, loss at exit and at 16)
    OUT/figures/               loss over training FLOPs (teacher forwards included) and against r, seed 0
    OUT/report.md              the tables: loss, share of the gap closed, exit depth, seed spread

    .venv/bin/python scripts/healing_study.py [--out runs/healing] [--seeds 0,1] [--arms ce-identity,distill]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from recurfit.cli import main as recurfit
from recurfit.evaluate.loss import load_examples
from recurfit.evaluate.over_training import RunEvaluation
from recurfit.model.loading import load_model
from recurfit.train.metrics import read_log

REPO = Path(__file__).resolve().parents[1]
# Every arm starts from the paper's learning rates (the CPU recipe's until this study moved it to 5 times them).
PAPER_RATES = ["optimizer.muon_lr=1e-3", "optimizer.lr=5e-5"]
# Each arm's overrides of the recipe (after PAPER_RATES). `adapter-then-all` is two chained runs (see `train`).
ARMS = {
    "ce-identity": [],  # plain next-token loss from the [0 | I] adapter (the pruned parent): the reference
    "ce-torch-default": ["model.adapter_init=torch-default"],  # the paper authors' start: nn.Linear's draw
    "distill": ["distill.alpha=0.5", "distill.temperature=2.0"],  # KL to the parent's next-token distribution
    "adapter-then-all": [],  # the adapter alone, then everything: one run's schedule in two runs (see `train`)
    "ce-adamw": ["optimizer.name=adamw", "optimizer.lr=5e-4"],  # every part under LoRA's optimizer: the control
    "ce-muon-5x": ["optimizer.muon_lr=5e-3", "optimizer.lr=2.5e-4"],  # Muon at 5 times the paper's rates
    "lora": [  # rank-16 LoRA on every kept layer, the adapter trained fully; AdamW (LoRA does not take Muon)
        "optimizer.name=adamw",
        "optimizer.lr=5e-4",
        "model.trainable=[adapter]",
        "lora.rank=16",
        "lora.alpha=32",
        "lora.parts=[prelude,core,coda]",
    ],
    "depth-supervision": ["depth.supervise.weighting=uniform"],  # the loss after every step with gradient
    "parent": ["model.shape=null"],  # the parent itself, trained on the same tokens: what training alone gives
}
# Trained with the first seed only: the random adapter start ends nats behind the others, and the parent is the
# reference line, so neither needs a seed spread.
FIRST_SEED_ONLY = ("ce-torch-default", "parent")
# adapter-then-all: the adapter alone for the first quarter of the steps, then everything, from its result. The
# two runs are one run (`stop_at`, `model.continue_schedule`): the second goes on with the first one's data, step
# count, LR schedule, curricula and depth draws, so the arm reads the same rows as every other arm.
ADAPTER_SHARE = 0.25
EXIT_THRESHOLD, EXIT_MIN_STEPS, EXIT_MAX = 5e-4, 2, 16
CURVE_RECURRENCES = "1,2,4,8,16,32"


def run(argv: list[str]) -> None:
    print("$ recurfit " + " ".join(map(str, argv)), flush=True)
    if recurfit([str(a) for a in argv]) != 0:
        sys.exit(f"recurfit {argv[0]} failed")


def train(recipe: Path, out: Path, arm: str, seed: int, steps: int, every: int) -> Path:
    """The arm's run (for adapter-then-all the second, chained run); trained unless it finished before."""
    common = [f"seed={seed}", f"steps={steps}", f"snapshots.every={every}", "eval.every=0", *PAPER_RATES]
    folder = out / "runs" / f"{arm}-s{seed}"
    if arm == "adapter-then-all":
        first_steps = min(max(1, round(steps * ADAPTER_SHARE)), steps - 1)
        first = out / "runs" / f"{arm}-s{seed}-adapter"
        chained = [f"model.init_from={first}", "model.continue_schedule=true", "model.shape=null", "model.path=null"]
        _check_chained(first, ("stop_at",), first_steps)
        _check_chained(folder, ("model", "continue_schedule"), True)
        if not (first / "final").is_dir():
            run(["train", recipe, "--out", first, *common, f"stop_at={first_steps}", "model.trainable=[adapter]"])
        if not (folder / "final").is_dir():  # the model comes from the first run's final/ folder
            run(["train", recipe, "--out", folder, *common, *chained])
        return folder
    if not (folder / "final").is_dir():
        run(["train", recipe, "--out", folder, *common, *ARMS[arm]])
    return folder


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


def evaluate(run_folder: Path, out: Path, store: str, baseline: str, rows: int, recurrences: str) -> Path:
    """Validation loss over training on `store` (continues an interrupted evaluation): the snapshots at the
    run's mean recurrence, the final model at each of `recurrences`."""
    target = out / "eval" / f"{run_folder.name}-{Path(store).name}"
    run(["eval", "loss", run_folder, "--data", store, "-r", recurrences, "--limit", rows,
         "--baseline", baseline, "--out", target])  # fmt: skip
    return target


@torch.no_grad()
def exit_depths(model_folder: Path, store: str, rows: int, chunk: int = 4) -> dict:
    """Teacher-forced adaptive depth on `store`'s validation rows: each token stops at the first step from
    EXIT_MIN_STEPS on where KL(p_s ‖ p_{s-1}) < EXIT_THRESHOLD (the rule of `--exit kl:5e-4`), else at EXIT_MAX.
    Returns the mean depth, and the loss at the exit depths against the loss at EXIT_MAX (equal quality?)."""
    model = load_model(str(model_folder), dtype=torch.float32).eval()
    if not hasattr(model.model, "final_hidden_states_at"):
        return {}
    ids = torch.tensor(load_examples(store, limit=rows).sequences)
    depths, at_exit, full = [], [], []
    generator = torch.Generator().manual_seed(0)
    for batch in ids.split(chunk):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        depth = torch.full(targets.shape, EXIT_MAX)
        target_log_p, previous = [], None
        for step, hidden in model.model.final_hidden_states_at(inputs, range(1, EXIT_MAX + 1), generator=generator):
            log_p = F.log_softmax(model.lm_head(hidden).float(), dim=-1)
            target_log_p.append(log_p.gather(-1, targets[..., None])[..., 0])
            if previous is not None and step >= EXIT_MIN_STEPS:
                settled = (log_p.exp() * (log_p - previous)).sum(-1) < EXIT_THRESHOLD
                depth = torch.where((depth == EXIT_MAX) & settled, torch.full_like(depth, step), depth)
            previous = log_p
        by_step = torch.stack(target_log_p)  # [step, row, position]
        depths.append(depth.flatten().float())
        at_exit.append(-by_step.gather(0, depth[None] - 1)[0].flatten())
        full.append(-by_step[-1].flatten())
    depth, at_exit, full = torch.cat(depths), torch.cat(at_exit), torch.cat(full)
    return {"mean_depth": depth.mean().item(), "loss_at_exit": at_exit.mean().item(), "loss_full": full.mean().item()}


def measured(path: Path, measure, *args) -> dict:
    """`measure(*args)`, kept in `path` so that a continued study does not measure it again."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measure(*args), indent=2) + "\n")
    return json.loads(path.read_text())


def summarise(folder: Path, evaluations: dict[str, Path], exits: dict) -> dict:
    """One run's numbers: training FLOPs (teacher included), final losses at r̄, start loss, exit depth."""
    final = json.loads((folder / "final" / "training.json").read_text())
    # adapter-then-all: the first, adapter-only run's compute counts too. Its second run continues the first's
    # counters (model.continue_schedule), so `earlier` adds only what preceded the chain (nothing here); the
    # first run's steps are timed in its own log.
    earlier = final.get("earlier") or {}
    flops = sum(record.get(key, 0.0) for record in (final, earlier) for key in ("flops_paper", "flops_teacher"))
    logs = [folder.parent / name for name in earlier.get("runs", []) if (folder.parent / name).is_dir()] + [folder]
    records = [r for log in logs for r in read_log(log) if r["kind"] == "train"]
    row = {"flops": flops, "seconds": sum(r["seconds"] for r in records), **exits}
    for store, path in evaluations.items():
        evaluation = RunEvaluation.load(path)
        row[f"{store}_final"] = evaluation.curve_row(evaluation.final).metrics["loss"]
        row[f"{store}_start"] = evaluation.curve_row(evaluation.sweeps[0]).metrics["loss"]
        row[f"{store}_parent"] = evaluation.final.parent.metrics["loss"] if evaluation.final.parent else None
        row[f"{store}_by_r"] = {str(r.steps): r.metrics["loss"] for r in evaluation.final.rows}
    return row


def report(results: dict[str, dict[int, dict]], stores: list[str], minutes: float) -> str:
    """The tables of docs/healing.md: mean over seeds, the spread between seeds, the share of the gap closed."""
    reference = "ce-identity"
    lines = [f"Study time: {minutes:.1f} minutes.", ""]
    header = ["arm", "seeds", "training TFLOPs (incl. teacher)"]
    for store in stores:
        header += [f"{store} loss (± half spread)", f"{store} gap closed"]
    header += ["exit depth (math)", "loss at exit − at r=16"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    spread = {}
    for arm, by_seed in results.items():
        seeds = sorted(by_seed)
        cells = [arm, ",".join(map(str, seeds)), f"{statistics.mean(r['flops'] for r in by_seed.values()) / 1e12:.1f}"]
        for store in stores:
            finals = [by_seed[s][f"{store}_final"] for s in seeds]
            half = (max(finals) - min(finals)) / 2
            spread[(arm, store)] = half
            cells.append(f"{statistics.mean(finals):.3f}" + (f" ± {half:.3f}" if len(seeds) > 1 else ""))
            closed = [_gap_closed(by_seed[s], results.get(reference, {}).get(s), store) for s in seeds]
            closed = [c for c in closed if c is not None]
            cells.append(f"{100 * statistics.mean(closed):.0f} %" if closed else "–")
        exits = [by_seed[s] for s in seeds if "mean_depth" in by_seed[s]]
        if exits:
            cells.append(f"{statistics.mean(e['mean_depth'] for e in exits):.2f}")
            cells.append(f"{statistics.mean(e['loss_at_exit'] - e['loss_full'] for e in exits):+.4f}")
        else:
            cells += ["–", "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", _differences(results, stores, spread, reference)]
    return "\n".join(lines) + "\n"


def _gap_closed(row: dict, reference: dict | None, store: str) -> float | None:
    """The share of the fresh retrofit's gap to the (untrained) parent that training closed: (start − final) /
    (start − parent), the start being the reference arm's step-0 retrofit (the parent arm has none of its own)."""
    start = (reference or row).get(f"{store}_start")
    parent = row.get(f"{store}_parent")
    if start is None or parent is None or start <= parent:
        return None
    return (start - row[f"{store}_final"]) / (start - parent)


def _differences(results, stores, spread, reference) -> str:
    """Which arms differ from the reference by more than both arms' seed spread."""
    lines = []
    for store in stores:
        base = results.get(reference, {})
        if not base:
            continue
        base_mean = statistics.mean(r[f"{store}_final"] for r in base.values())
        for arm, by_seed in results.items():
            if arm == reference or len(by_seed) < 2 or len(base) < 2:
                continue
            difference = statistics.mean(r[f"{store}_final"] for r in by_seed.values()) - base_mean
            noise = spread[(arm, store)] + spread[(reference, store)]
            verdict = "exceeds" if abs(difference) > noise else "within"
            lines.append(
                f"- {store}: {arm} − {reference} = {difference:+.3f} nats, {verdict} the seed spread ({noise:.3f})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-cpu.yaml")
    parser.add_argument("--out", type=Path, default=Path("runs/healing"))
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (default: all)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default: 0,1)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per arm (default: the recipe's 20)")
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16, help="validation rows per store (default 16)")
    parser.add_argument("--baseline", default="embedded", help="the untrained parent (default: embedded)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    recipe = yaml.safe_load(args.recipe.read_text())
    stores = recipe["data"]["validation"]
    names = [Path(store).name for store in stores]
    _prepare_data(recipe)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results: dict[str, dict[int, dict]] = {}
    for seed in seeds:
        # The loss against test recurrence is drawn from the first seed; the others give the seed spread of the
        # final loss at the training mean, which is all they need (half the study's evaluation time).
        recurrences = CURVE_RECURRENCES if seed == seeds[0] else str(recipe["depth"]["mean_recurrence"])
        for arm in args.arms.split(","):
            if seed != seeds[0] and arm in FIRST_SEED_ONLY:
                continue
            folder = train(args.recipe, args.out, arm, seed, args.steps, args.snapshot_every)
            evaluations = {
                name: evaluate(folder, args.out, store, args.baseline, args.rows, recurrences)
                for name, store in zip(names, stores)
            }
            math = next((s for s in stores if Path(s).name == "math"), stores[0])
            exits = measured(args.out / "exits" / f"{folder.name}.json", exit_depths, folder / "final", math, args.rows)
            results.setdefault(arm, {})[seed] = summarise(folder, evaluations, exits)
    arms = args.arms.split(",")
    for name in names:  # per store, the first seed's runs: all of them, and all but the random adapter start's
        evaluations = {arm: args.out / "eval" / f"{arm}-s{seeds[0]}-{name}" for arm in arms}
        run(["plot", *evaluations.values(), "--out", args.out / "figures" / name])
        near = [path for arm, path in evaluations.items() if arm != "ce-torch-default"]  # nats above the others
        run(["plot", *near, "--out", args.out / "figures" / f"{name}-without-random-adapter"])
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, names, (time.monotonic() - started) / 60)
    (args.out / "report.md").write_text(text)
    print(text)


def _prepare_data(recipe: dict) -> None:
    """The default recipe's stores, as its header prepares them (a recipe with its own stores brings them)."""
    for store in recipe["data"]["validation"]:
        if not Path(store).is_dir() and store in ("data/prose", "data/math"):
            source = "embedded:prose" if store.endswith("prose") else "embedded:math:4000"
            run(["data", "prepare", "--source", source, "--seq-len", "256", "--out", store])


if __name__ == "__main__":
    main()

"""`demo`: the main job (retrofit, heal, train, evaluate, report) on the Python API.

Defaults come from DemoSettings: its own, or, for the training values (left None here), the demo's recipe."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..demo.settings import DEPTH_TASK_TIME, DemoSettings
from ..errors import RecurfitError
from ..extras import require
from .common import MODEL_HELP, _placement, add_placement_arguments, console, positive_float, shape_arg, status

DEFAULTS = {f.name: f.default for f in dataclasses.fields(DemoSettings) if f.default is not dataclasses.MISSING}
RECIPE = "default: the demo's recipe, recipes/demo.yaml"  # the formatter adds the others' defaults
# The options that become DemoSettings fields of the same name
FIELDS = (
    *("model", "shape", "steps", "mean_recurrence", "muon_lr", "lr"),
    *("math_problems", "math_eval", "gsm8k", "max_new_tokens", "force", "device", "dtype"),
)


def add_parsers(commands) -> None:
    p = commands.add_parser("demo", help="the main job: retrofit, heal, train, evaluate; writes OUT/report.md")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--shape",
        type=shape_arg,
        help="P,R,C by the paper's rule (default: from the parent's layer count L, L//5 for prelude and coda and "
        "twice that for the core: 6,12,6 for the embedded model's 30 layers)",
    )
    p.add_argument(
        "--steps", type=int, help=f"optimizer steps: a quarter healing on prose, then prose and math ({RECIPE})"
    )
    p.add_argument("--mean-recurrence", type=int, help=f"train recurrence the curriculum ramps to ({RECIPE})")
    p.add_argument("--muon-lr", type=positive_float, help=f"Muon's rate ({RECIPE}: 5 × the paper's rate)")
    p.add_argument("--lr", type=positive_float, help=f"AdamW's rate for embeddings and norms ({RECIPE})")
    p.add_argument(
        "--math-problems",
        type=int,
        default=DEFAULTS["math_problems"],
        help="fresh math problems to generate for training",
    )
    p.add_argument(
        "--math-eval",
        type=int,
        default=DEFAULTS["math_eval"],
        help="held-out word problems to score per split (easy, hard), the first N (at most 200)",
    )
    p.add_argument(
        "--gsm8k",
        type=int,
        default=DEFAULTS["gsm8k"],
        help="GSM8K test problems to score, the first N",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULTS["max_new_tokens"],
        help="tokens generated per GSM8K answer and sample",
    )
    p.add_argument("--out", default=str(DEFAULTS["out"]), help="run folder, replaced only with --force")
    p.add_argument(
        "--force",
        action="store_true",
        help="start over in an existing --out (with --depth-task: replace OUT/depth-task only)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the shape, the memory plan and the training time on this machine (one step of each model, "
        "timed on random weights), then exit without training",
    )
    p.add_argument(
        "--depth-task",
        action="store_true",
        help=f"run the depth-task act alone: the embedded model's retrofit and parent trained on the same k-hop "
        f"lookups, accuracy against r per hop count ({DEPTH_TASK_TIME}); writes OUT/depth-task/",
    )
    p.add_argument(
        "--depth-recipe",
        metavar="FILE",
        help="with --depth-task: a YAML file of its training and scoring settings (such as "
        "recipes/depth-task/gpu.yaml) instead of the defaults",
    )
    add_placement_arguments(p, "precision of the evaluated models; auto: bfloat16 on a GPU, float32 on a CPU")
    p.set_defaults(run=cmd_demo)


def cmd_demo(args) -> None:
    """The main job: retrofit, heal, train, evaluate against the parent trained on the same tokens; a report."""
    given = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    settings = DemoSettings(out=Path(args.out), **given)
    placement = _placement(args)  # a bad --device or --dtype fails now, not after training; --threads applies
    if args.depth_task:
        return _depth_task(args, placement.device)
    if args.depth_recipe:
        raise RecurfitError("--depth-recipe sets the depth task's recipe; add --depth-task.")
    if args.dry_run:
        from ..demo.dry_run import dry_run

        return dry_run(settings, console)  # the plan is the result: stdout
    require("`recurfit demo`", "eval", "data")  # its data is embedded:prose; it evaluates on tasks, draws figures
    from ..demo import run

    report = run.run_demo(settings, status)  # stages, progress and times: stderr
    if report is not None:
        console.print(f"Wrote {report}.", highlight=False)  # the result: stdout


def _depth_task(args, device) -> None:
    from ..train.depth_task import DepthRecipeFile, load_depth_recipe

    if args.model:  # its prelude, core and coda are the embedded model's layers, chosen by where its lookups happen
        raise RecurfitError("--depth-task runs on the embedded model only; leave out --model.")
    if args.dtype not in ("auto", "float32"):  # the recipe is measured in float32 only
        raise RecurfitError(f"--depth-task trains and scores in float32; leave out --dtype {args.dtype}.")
    require("`recurfit demo --depth-task` (its figure)", "plots")
    from ..demo.depth_act import run_depth_act

    file = load_depth_recipe(args.depth_recipe) if args.depth_recipe else DepthRecipeFile()
    run_depth_act(Path(args.out), status, force=args.force, recipe=file.train, scoring=file.score, device=device)

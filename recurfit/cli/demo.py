"""`demo`: the main job (retrofit, heal, train, evaluate, report) on the Python API."""

from __future__ import annotations

from pathlib import Path

from .common import MODEL_HELP, _placement, add_placement_arguments, console, positive_float, shape_arg


def add_parsers(commands) -> None:
    p = commands.add_parser("demo", help="the main job: retrofit, heal, train, evaluate; writes OUT/report.md")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--shape", type=shape_arg, default=(6, 12, 6), help="P,R,C by the paper's rule (default 6,12,6)")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps of 4 × 256 tokens (a quarter healing)")
    p.add_argument("--mean-recurrence", type=int, default=4, help="train recurrence the curriculum ramps to")
    p.add_argument(
        "--muon-lr", type=positive_float, default=5e-3, help="Muon's rate (default 5e-3, 5 × the paper's 1e-3)"
    )
    p.add_argument(
        "--lr", type=positive_float, default=2.5e-4, help="AdamW's rate for embeddings and norms (default 2.5e-4)"
    )
    p.add_argument("--math-problems", type=int, default=4000, help="fresh math problems to generate for training")
    p.add_argument("--gsm8k", type=int, default=16, help="GSM8K test problems to score (the first N)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per GSM8K answer and sample")
    p.add_argument("--out", default="runs/demo", help="run folder (replaced only with --force)")
    p.add_argument("--force", action="store_true", help="start over in an existing --out")
    add_placement_arguments(p, "precision of the evaluated models; auto: bfloat16 on a GPU, float32 on a CPU")
    p.set_defaults(run=cmd_demo)


def cmd_demo(args) -> None:
    """The main job: retrofit, heal, train, evaluate against the parent trained on the same tokens; a report."""
    from ..demo import DemoSettings, run_demo

    settings = DemoSettings(
        out=Path(args.out),
        model=args.model,
        shape=args.shape,
        steps=args.steps,
        heal_steps=max(args.steps // 4, 1),
        mean_recurrence=args.mean_recurrence,
        muon_lr=args.muon_lr,
        lr=args.lr,
        math_problems=args.math_problems,
        gsm8k=args.gsm8k,
        max_new_tokens=args.max_new_tokens,
        force=args.force,
        device=args.device,
        dtype=args.dtype,
    )
    _placement(args)  # a bad --device or --dtype fails now, not after training; --threads applies
    run_demo(settings, console)

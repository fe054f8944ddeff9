"""Checkpoints that are whole or absent, checked before use, and resume from the newest readable one.

One process writes whole (unsharded) states:

    OUT/checkpoints/step-000120/
        model.safetensors   full weights, keyed like the model's state dict
        optimizer.pt        optimiser and LR-schedule states, keyed by parameter name (torch.load weights_only)
        trainer.json        step, data-stream position, counters, and the config the run was started with
        sha256sums.txt      the SHA-256 of the files above (`sha256sum -c sha256sums.txt` checks by hand)

Processes in a group (torchrun) write their own shards instead, through `torch.distributed.checkpoint` (DCP): no
process gathers or holds the whole model or optimizer, and DCP reshards on load, so the checkpoint resumes on any
number of processes (one included):

    OUT/checkpoints/step-000120/
        state/              model and optimiser states: each process's shards (`__R_N.distcp`) and DCP's `.metadata`
        trainer.json        as above, with the LR schedules' states
        sha256sums.txt      every file's SHA-256, each process hashing the files it wrote

A checkpoint is written into a hidden staging folder and renamed into place, so a crash mid-write leaves only
the staging folder (ignored and cleaned up), never a `step-*` folder that loads wrong. The last `keep` are
kept. On resume the checksums are verified before any tensor is used, the processes sharing the files out (each
hashes 1/W of them; every process learns of any mismatch): a damaged checkpoint (flipped bytes, a truncated file,
a hand-edited one) is skipped on every process with a message naming the file, and the run resumes from the newest
checkpoint that reads back whole. DCP's metadata is a pickle: it is read only
after its checksum matched and a restricted unpickler found nothing in it but DCP's own classes.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import pickle
import re
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import RecurfitError
from ..io.files import staged_directory
from .distributed import Processes

STEP_FOLDER = re.compile(r"^step-(\d{6,})$")
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
MODEL, OPTIMIZER, TRAINER, SUMS = "model.safetensors", "optimizer.pt", "trainer.json", "sha256sums.txt"
STATE = "state"  # a sharded checkpoint's DCP folder
TRAINER_KEYS, OPTIMIZER_KEYS = ("counters", "stream", "config"), ("optimizers", "schedulers")


def checkpoint_folders(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return [path for _, path in sorted(found)]


def gather_state(model, optimizers) -> tuple[dict, list[dict]]:
    """Full model and optimiser state dicts (collective under FSDP: call on every rank)."""
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_states = [get_optimizer_state_dict(model, optimizer, options=FULL) for optimizer in optimizers]
    return model_state, optimizer_states


def write_checkpoint(
    root: Path, step: int, model_state: dict, optimizer_states: list[dict], schedulers, trainer: dict, keep: int
) -> Path:
    """Write a checkpoint atomically (rank 0 only) and drop all but the newest `keep`."""
    target = root / f"step-{step:06d}"
    try:
        with staged_directory(target, replace=True) as staging:
            save_file(_unshared(model_state), staging / MODEL)
            schedules = [s.state_dict() for s in schedulers]
            torch.save({"optimizers": optimizer_states, "schedulers": schedules}, staging / OPTIMIZER)
            (staging / TRAINER).write_text(json.dumps(trainer, indent=2) + "\n")
            sums = "".join(f"{_sha256(staging / name)}  {name}\n" for name in (MODEL, OPTIMIZER, TRAINER))
            (staging / SUMS).write_text(sums)
    except OSError as problem:  # out of disk, permissions: the staging folder is gone, older checkpoints intact
        raise _cannot_write(target, problem) from None
    _drop_old(root, keep)
    return target


def save_checkpoint(
    root: Path, step: int, model, optimizers, schedulers, trainer: dict, keep: int, processes: Processes
) -> None:
    """Step `step`'s checkpoint (collective: call on every process): whole states from a process alone, each
    process's shards from a group (DCP); then all but the newest `keep` dropped."""
    if not processes.grouped:
        model_state, optimizer_states = gather_state(model, optimizers)
        write_checkpoint(root, step, model_state, optimizer_states, schedulers, trainer, keep)
        return
    target = root / f"step-{step:06d}"
    try:
        with _staged_on_main(target, processes) as staging:
            state = {"model": get_model_state_dict(model), "optimizers": sharded_optimizer_states(model, optimizers)}
            optimized = [list(optimizer_state["state"]) for optimizer_state in state["optimizers"]]
            dcp.save(state, storage_writer=FileSystemWriter(staging / STATE))
            del state
            # dcp.save ends once every process has written: every file is there, and the processes share the hashing
            files = sorted(path.relative_to(staging).as_posix() for path in (staging / STATE).iterdir())
            hashed = processes.gather(
                {name: _sha256(staging / name) for name in files[processes.rank :: processes.world]}
            )
            if processes.is_main:
                schedules = [scheduler.state_dict() for scheduler in schedulers]
                record = {**trainer, "schedulers": schedules, "optimized": optimized}
                (staging / TRAINER).write_text(json.dumps(record, indent=2) + "\n")
                sums = {name: digest for share in hashed for name, digest in share.items()}
                sums[TRAINER] = _sha256(staging / TRAINER)
                (staging / SUMS).write_text("".join(f"{sums[name]}  {name}\n" for name in sorted(sums)))
    except OSError as problem:
        raise _cannot_write(target, problem) from None
    processes.barrier()  # published before any process goes on
    if processes.is_main:
        _drop_old(root, keep)


@contextmanager
def _staged_on_main(target: Path, processes: Processes):
    """`staged_directory` of the main process, its staging folder shared with the others, which write into it."""
    if not processes.is_main:
        yield processes.broadcast(None)
        return
    with staged_directory(target, replace=True) as staging:
        yield processes.broadcast(staging)


def sharded_optimizer_states(model, optimizers) -> list[dict]:
    """Each optimiser's state dict keyed by parameter name, each process holding its shards (DTensors under FSDP2)."""
    return [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers]


def _cannot_write(target: Path, problem: OSError) -> RecurfitError:
    """Out of disk, permissions: the staging folder is gone, older checkpoints intact."""
    return RecurfitError(
        f"Cannot write the checkpoint {target} ({problem.strerror or problem}); free space or set out= "
        "elsewhere, then --resume from the last complete checkpoint."
    )


def _drop_old(root: Path, keep: int) -> None:
    for old in checkpoint_folders(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _unshared(state: dict) -> dict:
    """safetensors refuses tensors that share memory (tied embeddings): give the duplicates their own copy."""
    seen, result = set(), {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        key = (tensor.data_ptr(), tensor.shape)
        result[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return result


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- reading back


class DamagedCheckpoint(RecurfitError):
    """A checkpoint folder that does not read back whole."""


@dataclass
class Checkpoint:
    folder: Path
    model_state: dict | None  # None in a sharded checkpoint: DCP reads each process's part when it is restored
    optimizer: dict | None  # {"optimizers": [...], "schedulers": [...]}; None in a sharded checkpoint
    trainer: dict

    @property
    def step(self) -> int:
        return self.trainer["counters"]["step"]

    @property
    def sharded(self) -> bool:
        return self.model_state is None


def read_checkpoint(
    folder: Path, warn: Callable[[str], None] = print, verify: bool = True, processes: Processes | None = None
) -> Checkpoint:
    """Verify the checksums (`processes`: shared out among them, a collective), then read the files; a
    DamagedCheckpoint names the file and the problem (on every process)."""
    sharded = (folder / STATE).is_dir()
    if verify:
        _verify(folder, warn, sharded, processes or Processes())
    if sharded:
        return _read_sharded(folder)
    where = folder / MODEL
    try:
        model_state = load_file(where)
        where = folder / OPTIMIZER
        optimizer = torch.load(where, weights_only=True, map_location="cpu")
        where = folder / TRAINER
        trainer = json.loads(where.read_text())
    except Exception as problem:  # noqa: BLE001 (safetensors, pickle, JSON and OS errors: it does not read back)
        raise DamagedCheckpoint(f"{where} cannot be read ({type(problem).__name__}: {_first_line(problem)})") from None
    if not isinstance(optimizer, dict) or not all(isinstance(optimizer.get(k), list) for k in OPTIMIZER_KEYS):
        raise DamagedCheckpoint(f"{folder / OPTIMIZER} does not hold optimizer and schedule states")
    missing = [key for key in TRAINER_KEYS if not isinstance(trainer, dict) or not isinstance(trainer.get(key), dict)]
    if missing:
        raise DamagedCheckpoint(f"{folder / TRAINER} lacks {', '.join(map(repr, missing))}")
    return Checkpoint(folder, model_state, optimizer, trainer)


def _read_sharded(folder: Path) -> Checkpoint:
    """A sharded checkpoint's trainer state, its DCP metadata checked for what it unpickles; DCP reads the tensors
    when the checkpoint is restored."""
    try:
        trainer = json.loads((folder / TRAINER).read_text())
    except Exception as problem:  # noqa: BLE001 (JSON and OS errors: it does not read back)
        raise DamagedCheckpoint(f"{folder / TRAINER} cannot be read ({_first_line(problem)})") from None
    keys = (*TRAINER_KEYS, "schedulers", "optimized")
    missing = [key for key in keys if not isinstance(trainer, dict) or key not in trainer]
    if missing:
        raise DamagedCheckpoint(f"{folder / TRAINER} lacks {', '.join(map(repr, missing))}")
    _check_metadata(folder / STATE / ".metadata")
    return Checkpoint(folder, None, None, trainer)


class _DcpMetadata(pickle.Unpickler):
    """An unpickler that builds DCP's own metadata classes, torch's sizes, dtypes, layouts and memory formats, and
    file paths, and nothing else."""

    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
        ("collections", "OrderedDict"),
        *((module, path) for module in ("pathlib", "pathlib._local") for path in ("PosixPath", "WindowsPath")),
    }
    TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module: str, name: str):
        torch_value = module == "torch" and isinstance(getattr(torch, name, None), self.TORCH_VALUES)
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in self.ALLOWED or torch_value:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _check_metadata(path: Path) -> None:
    """DCP unpickles its `.metadata`: refuse one that would build anything but DCP's metadata."""
    try:
        _DcpMetadata(io.BytesIO(path.read_bytes())).load()
    except Exception as problem:  # noqa: BLE001 (pickle and OS errors: it does not read back)
        raise DamagedCheckpoint(f"{path} cannot be read ({type(problem).__name__}: {_first_line(problem)})") from None


def _verify(folder: Path, warn: Callable[[str], None], sharded: bool, processes: Processes) -> None:
    """Every file's SHA-256 against `sha256sums.txt`, the files dealt out in turn to the processes (a 1B model's
    checkpoint is ~12 GB: each hashes 1/W of it); the first mismatch, in the files' order, is raised on
    every process, whichever found it. The main process reads the list, so that every process checks the same."""
    listed = processes.broadcast(_listed_sums(folder, sharded) if processes.is_main else None)
    if listed is None:
        # Checkpoints appear whole (a staged folder renamed into place), so one without sums was written by a
        # recurfit that did not record them: read it, unverified, rather than strand the run.
        warn(f"{folder} has no {SUMS} (written by an earlier recurfit): its files are read without verification.")
        return
    share = [(place, name, digest) for place, (name, digest) in enumerate(listed.items())]
    share = share[processes.rank :: processes.world]
    found = [problem for problem in processes.gather(_first_mismatch(folder, share)) if problem is not None]
    if found:
        raise DamagedCheckpoint(min(found)[1])


def _listed_sums(folder: Path, sharded: bool) -> dict[str, str | None] | None:
    """The files a checkpoint's sums file lists (a whole one's three in any case), each with its SHA-256 (None where
    it lists none), in the order they are checked; None when it has no sums file."""
    sums = folder / SUMS
    if not sums.is_file():
        return None
    expected = dict(reversed(line.split(maxsplit=1)) for line in sums.read_text().splitlines() if line.strip())
    names = (*sorted(expected.keys() - {TRAINER}), TRAINER) if sharded else (MODEL, OPTIMIZER, TRAINER)
    return {name: expected.get(name) for name in names}


def _first_mismatch(folder: Path, share: list[tuple[int, str, str | None]]) -> tuple[int, str] | None:
    """(its place in the check, what is wrong) for the first file of `share` (place, name, SHA-256) that is missing or
    does not match its checksum; None if all do."""
    for place, name, digest in share:
        path = folder / name
        if not path.is_file():
            return place, f"{path} is missing"
        if _sha256(path) != digest:
            return place, f"{path} does not match its checksum in {SUMS} (its bytes changed on disk)"
    return None


def _first_line(problem: Exception) -> str:
    return (str(problem).strip().splitlines() or [""])[0][:200]


def newest_readable(
    root: Path, warn: Callable[[str], None] = print, processes: Processes | None = None
) -> Checkpoint | None:
    """The newest checkpoint under `root` that reads back whole, or None if there is none at all (a collective
    under `processes`: they verify each together, and choose the same). A damaged newer one is reported through
    `warn` and skipped; if every one is damaged, that is an error with the fix, on every process."""
    processes = processes or Processes()
    folders = processes.broadcast(checkpoint_folders(root) if processes.is_main else None)  # the main one's view
    problems = []
    for folder in reversed(folders):
        try:
            checkpoint = read_checkpoint(folder, warn, processes=processes)
        except DamagedCheckpoint as problem:
            problems.append(str(problem))
            continue
        for problem in problems:
            warn(f"Skipping a damaged checkpoint: {problem}. Resuming from {folder.name} instead.")
        return checkpoint
    if problems:
        raise RecurfitError(
            f"Cannot read checkpoint {problems[0]}, and no older checkpoint reads back whole; start the run "
            "over with --force (or restore the folder from a copy)."
        )
    return None


def restore(checkpoint: Checkpoint, model, optimizers, schedulers) -> dict:
    """Load a checkpoint's states into model, optimisers and schedules in place (on every rank); return the
    trainer state."""
    if _optimizers_saved(checkpoint) != len(optimizers):
        raise RecurfitError(
            f"{checkpoint.folder} was written with another optimizer; resume with the config the run started with."
        )
    if checkpoint.sharded:
        model_state, optimizer_states = _load_sharded(checkpoint, model, optimizers)
        options, schedules = StateDictOptions(), checkpoint.trainer["schedulers"]
    else:
        model_state, optimizer_states = checkpoint.model_state, checkpoint.optimizer["optimizers"]
        options, schedules = StateDictOptions(full_state_dict=True), checkpoint.optimizer["schedulers"]
    set_model_state_dict(model, model_state, options=options)
    for optimizer, state in zip(optimizers, optimizer_states):
        _load_optimizer_state(model, optimizer, state, options)
    for scheduler, state in zip(schedulers, schedules):
        scheduler.load_state_dict(state)
    return checkpoint.trainer


def _optimizers_saved(checkpoint: Checkpoint) -> int:
    return len(checkpoint.trainer["optimized"] if checkpoint.sharded else checkpoint.optimizer["optimizers"])


def _load_sharded(checkpoint: Checkpoint, model, optimizers, carried: bool = False) -> tuple[dict | None, list[dict]]:
    """This process's part of a sharded checkpoint's model and optimiser states, in the model's current layout
    (DCP reshards: any number of processes, one included). `carried` (another run carrying the optimiser states):
    no model state is read, the optimisers may update parameters the checkpoint has no state for (they keep the
    state torch initialised), and they keep their own parameter groups."""
    optimizer_states = sharded_optimizer_states(model, optimizers)
    groups = [copy.deepcopy(state["param_groups"]) for state in optimizer_states] if carried else None
    state = (
        {"optimizers": optimizer_states}
        if carried
        else {"model": get_model_state_dict(model), "optimizers": optimizer_states}
    )
    reader = FileSystemReader(checkpoint.folder / STATE)
    dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=carried))
    for optimizer_state, own in zip(optimizer_states, groups or []):
        optimizer_state["param_groups"] = own  # this run's parameters, not the earlier run's
    return state.get("model"), optimizer_states


def carry_optimizer_states(checkpoint: Checkpoint, model, optimizers, shared_only: bool = False) -> None:
    """Load a checkpoint's optimiser states (moments, step counts) into `optimizers` while keeping their own
    hyperparameters (LR, betas, weight decay): a chained run carries the state, its schedule starts afresh.
    `shared_only`: the two runs may train different parameters; those they share carry their state, the others
    start afresh (model.continue_schedule)."""
    if _optimizers_saved(checkpoint) != len(optimizers):
        raise RecurfitError(
            f"{checkpoint.folder} was written with another optimizer; give the run it continues the same "
            "optimizer.name, or drop model.carry_state."
        )
    if checkpoint.sharded:
        return _carry_sharded(checkpoint, model, optimizers)
    for optimizer, state in zip(optimizers, checkpoint.optimizer["optimizers"]):
        settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        fresh = []
        if shared_only:
            state, fresh = _shared_state(model, optimizer, state)
        _load_optimizer_state(model, optimizer, state)
        for parameter in fresh:  # torch's loader gave it the state of a step with zero gradient (AdamW: step 1)
            optimizer.state.pop(parameter, None)
        for group, own in zip(optimizer.param_groups, settings):
            group.update(own)


def _carry_sharded(checkpoint: Checkpoint, model, optimizers) -> None:
    """carry_optimizer_states from a sharded checkpoint: DCP reads the state of the parameters both runs update into
    this run's own layout; the others start afresh."""
    settings = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers]
    _, states = _load_sharded(checkpoint, model, optimizers, carried=True)
    by_name = dict(model.named_parameters())
    for optimizer, state, groups, saved in zip(optimizers, states, settings, checkpoint.trainer["optimized"]):
        _load_optimizer_state(model, optimizer, state, StateDictOptions())
        for name in set(state["state"]) - set(saved):
            optimizer.state.pop(by_name[name], None)
        for group, setting in zip(optimizer.param_groups, groups):
            group.update(setting)


def _shared_state(model, optimizer, saved: dict) -> tuple[dict, list]:
    """`saved` (a full optimizer state dict, keyed by parameter name) laid out as `optimizer`'s own: the state of
    each parameter `optimizer` updates that `saved` holds; and the parameters it does not hold (to start afresh)."""
    if not any(group["params"] for group in optimizer.param_groups):
        return saved, []  # nothing to update: nothing is loaded (_load_optimizer_state)
    # Reading the optimizer's own state makes torch initialise it (a step with zero gradients); those states stand
    # in for the parameters `saved` lacks, because torch's loader (2.9) needs a state for every parameter.
    own = get_optimizer_state_dict(model, optimizer, options=FULL)
    names = [name for group in own["param_groups"] for name in group["params"]]
    missing = {name for name in names if name not in saved["state"]}
    state = {name: own["state"][name] if name in missing else saved["state"][name] for name in names}
    fresh = [parameter for name, parameter in model.named_parameters() if name in missing]
    return {"state": state, "param_groups": own["param_groups"]}, fresh


def _load_optimizer_state(model, optimizer, state: dict, options: StateDictOptions | None = None) -> None:
    """`set_optimizer_state_dict` (of a full state dict unless `options` say otherwise), except for an optimizer with
    nothing to update (AdamW beside Muon when only hidden matrices train): it has no state to load, and torch's
    loader cannot place an empty one."""
    if any(group["params"] for group in optimizer.param_groups):
        options = options or StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)

"""The training loop: one optimizer step at a time, nanoGPT-style, on one process or under torchrun.

Per step:
  1. the depth (n, k) from the curriculum and the step-seeded sampler (the same on every rank, and on resume);
  2. the next global batch of rows from the data stream, this rank's share split into micro-batches;
  3. forward (n steps without gradient, k with) and backward per micro-batch, gradients accumulated; the loss
     is the next-token CE, or the healing objective of `distill` and `depth.supervise` (losses.py);
  4. a non-finite loss or gradient skips the update (counted; too many in a row stop the run), unless
     `nonfinite: apply` applies every update as the paper authors' loop did;
  5. clip, optimizer and LR-schedule step; log; validate and checkpoint on their schedule.

Every source of randomness is a function of (seed, step, row): the data order, the depth draw, and the
initial recurrent state (re-seeded per micro-batch from its first global row). A resumed run, or the same
global batch split over any number of processes, therefore computes the same losses.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import TextColumn

from ..data import Phase, RowStream, TokenStore
from ..errors import RecurfitError
from ..io.files import staged_directory
from ..io.lock import owned
from ..model.accounting import (
    count_parameters,
    paper_flops_per_token,
    paper_ramp,
    paper_training_flops,
    training_flops_per_token,
)
from ..model.card import write_model_card
from ..model.loading import optional_tokenizer, save_tokenizer
from ..model.sampling import Curriculum, DepthSchedule, mixed_seed
from ..progress import progress_bar, size_text
from .checkpoint import (
    Checkpoint,
    carry_optimizer_states,
    gather_state,
    newest_readable,
    read_checkpoint,
    restore,
    write_checkpoint,
)
from .config import TrainConfig
from .distributed import Processes
from .initial_model import build_model, is_recurrent
from .lora import merged
from .losses import HealingLoss, Teacher, cross_entropy, describe
from .metrics import MetricsLog, peak_flops, read_log, validation_columns
from .optim import BatchedMuon, advance, build_optimizers, build_schedulers, global_grad_norm
from .parts import check_carry, select_parts, trained_parts_line
from .run_folder import TRAINING_RECORD, RunFolder, changed_settings, check_continuation, earlier_training


@dataclass
class Counters:
    """Everything the loop accumulates that a resumed run must continue from."""

    step: int = 0  # optimizer steps done
    tokens: int = 0
    flops: float = 0.0  # from the depths actually drawn
    flops_paper: float = 0.0  # the paper's rule: mean recurrence and backprop depth of each step
    flops_teacher: float = 0.0  # distillation: the teacher's forward passes (not in `flops`)
    skipped: int = 0  # updates skipped for a non-finite loss or gradient
    bad_in_row: int = 0


@dataclass
class TrainResult:
    out: Path
    counters: Counters
    losses: list[float] = field(default_factory=list)  # per step run in this process (not the resumed prefix)
    already_finished: bool = False  # --resume of a finished run: nothing was done
    validation: dict | None = None  # the final validation record (store/loss@r: loss), if the run validates


def depth_schedule(config: TrainConfig) -> DepthSchedule:
    """The curricula as the paper authors' scripts computed them: ramps of ceil(fraction · steps) steps; the
    mean recurrence climbs from 0 (at least 1), the backprop depth from 1, one step ahead."""
    depth, steps = config.depth, config.steps
    return DepthSchedule(
        Curriculum(depth.mean_recurrence, depth.curriculum, math.ceil(depth.curriculum_fraction * steps)),
        Curriculum(
            depth.backprop_depth,
            depth.backprop_curriculum,
            math.ceil(depth.backprop_curriculum_fraction * steps),
            start=1,
            lead=1,
        ),
        seed=config.seed,
        fixed=depth.fixed,
    )


def paper_accounting_depth(config: TrainConfig, step: int) -> tuple[int, int]:
    """(r, k̄) of optimizer step `step` as the paper's FLOPs accounting counts it (`accounting.paper_ramp`, its
    boundaries rounded by `depth.paper_ramp_rounding`)."""
    depth, steps = config.depth, config.steps
    ramps = [
        (depth.mean_recurrence, depth.curriculum, depth.curriculum_fraction),
        (depth.backprop_depth, depth.backprop_curriculum, depth.backprop_curriculum_fraction),
    ]
    r, k = (paper_ramp(step, *ramp, steps, depth.paper_ramp_rounding) for ramp in ramps)
    return r, k


def paper_run_flops(config: TrainConfig, counts: dict, step: int, tokens_per_step: int) -> float:
    """The paper's training FLOPs of `config`'s run after `step` steps of `tokens_per_step` tokens
    (`accounting.paper_training_flops`, every depth setting taken from the config)."""
    depth = config.depth
    return paper_training_flops(
        counts,
        step,
        tokens_per_step,
        total_steps=config.steps,
        mean_recurrence=depth.mean_recurrence,
        backprop_depth=depth.backprop_depth,
        curriculum=depth.curriculum,
        curriculum_fraction=depth.curriculum_fraction,
        backprop_curriculum=depth.backprop_curriculum,
        backprop_curriculum_fraction=depth.backprop_curriculum_fraction,
        ramp_rounding=depth.paper_ramp_rounding,
    )


class Trainer:
    def __init__(
        self, config: TrainConfig, resume: bool = False, processes: Processes | None = None, force: bool = False
    ):
        self.config, self.out = config, Path(config.out)
        self.processes = processes or Processes.from_environment(config.distributed_timeout)
        self.folder = RunFolder(self.out)
        self.ownership = ExitStack()  # the folder's lock, held by the main process until the run ends
        if self.processes.is_main:
            self.ownership.enter_context(owned(self.out))
        try:
            self._set_up(resume, force)
        except BaseException:
            self.ownership.close()
            raise

    def _set_up(self, resume: bool, force: bool) -> None:
        config = self.config
        if self.processes.is_main:
            self.folder.remove_leftovers()
        self.folder.check_start(resume, force)
        model = select_parts(build_model(config.model, config.depth, config.seed), config)
        self.model = model.to(self.processes.device)
        self.tokenizer = optional_tokenizer(config.model.source)  # saved with every snapshot and the final model
        self._say(trained_parts_line(self.model, config))
        self.recurrent = is_recurrent(self.model)
        self.parameter_counts = count_parameters(self.model)
        self.stream = RowStream(
            [Phase({s.path: s.weight for s in p.sources}, p.tokens) for p in config.data.phases],
            seed=config.seed,
            vocab_size=self.model.config.vocab_size,
        )
        self.validation = [TokenStore(path, "val") for path in config.data.validation]
        self._check_vocabulary()
        self._check_validation()
        self.schedule = depth_schedule(config)
        self.earlier = earlier_training(config.model.init_from, continued=config.model.continue_schedule)
        if config.compile:
            for layer in self._layers():
                layer.compile()
        self.wrapped = self.processes.wrap(self.model, config.distributed, bf16=self._bf16(config.precision))
        self._set_up_healing()
        self.optimizers = build_optimizers(self.model, config.optimizer)
        self.schedulers = build_schedulers(self.optimizers, config.optimizer, config.steps)
        self.counters = Counters()
        self.start_step = 0  # where this run's schedule starts: 0, or where the run it continues stopped
        if resume:
            self._resume()
        if self.counters.step == 0 and (config.model.carry_state or config.model.continue_schedule):
            self._carry_state()
        self.resumed_at = self.counters.step
        if force and self.processes.is_main:  # the new run is set up: only now is the old one deleted
            self.folder.clear()
        self.log = None
        if self.processes.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(config.to_yaml())
            self.log = MetricsLog(
                self.out,
                resume_step=self.counters.step if resume else None,
                tensorboard=config.log.tensorboard,
                wandb=config.log.wandb,
                config=config.to_dict(),
            )
        self._write(self._start_record())
        self._announce_snapshots()

    def _start_record(self) -> dict:
        """The log's first record of each (re)start: what ran where, and the precision Muon orthogonalises in."""
        device = self.processes.device
        record = {"kind": "start", "step": self.counters.step, "torch": torch.__version__, "device": str(device)}
        record["processes"] = self.processes.world
        if self.teacher is not None:
            record["distill"] = {**self.config.to_dict()["distill"], "teacher": self.teacher.name}
        if self.healing.supervise is not None:
            record["depth_supervision"] = self.config.to_dict()["depth"]["supervise"]
        if device.type == "cpu":
            record["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        muon = next((o for o in self.optimizers if isinstance(o, BatchedMuon)), None)
        if muon is not None:
            record["muon_dtype"] = str(muon.ns_dtype).removeprefix("torch.")
            if self.config.optimizer.muon_dtype != "auto":
                why = "optimizer.muon_dtype"
            elif record["muon_dtype"] == "float32":
                why = f"auto: this CPU ({record.get('cpu_capability')}) has no native bf16 matmul"
            else:
                why = "auto"
            self._say(f"Muon orthogonalises in {record['muon_dtype']} ({why}).")
        return record

    # ------------------------------------------------------------ set-up checks

    def _set_up_healing(self) -> None:
        """The training objective, and the teacher to distil from (loaded afresh on every start and resume)."""
        config = self.config
        if config.depth.supervise is not None and not self.recurrent:
            raise RecurfitError(
                "depth.supervise reads the loss out at several recurrences, but this model is not recurrent (a "
                "baseline); drop depth.supervise."
            )
        self.healing = HealingLoss(config.distill, config.depth.supervise)
        self.teacher = None
        if config.distill is not None:
            vocab = self.model.config.vocab_size
            self.teacher = Teacher(config.distill, config.model, vocab, self.processes, config.distributed)
        for line in describe(config.distill, config.depth.supervise, self.teacher):
            self._say(line)

    def _check_vocabulary(self) -> None:
        vocab = self.model.config.vocab_size
        for store in [*self.stream.stores, *self.validation]:
            if store.vocab_size > vocab:
                raise RecurfitError(
                    f"{store.folder} was tokenised with a {store.vocab_size}-token vocabulary "
                    f"({store.meta.get('tokenizer') or 'unknown tokenizer'}), larger than the model's {vocab}: "
                    "prepare the data with the model's own tokenizer."
                )

    def _check_validation(self) -> None:
        """Every validation store has rows to evaluate, and the run says which stores it evaluates."""
        for store in self.validation:
            if len(store) == 0:
                raise RecurfitError(
                    f"data.validation: {store.folder} has no validation rows (it was prepared with --val-fraction "
                    f"{store.meta.get('val_fraction', 0)}); prepare it again with a larger --val-fraction, or drop "
                    "it from data.validation."
                )
            self.stream.check_ids(store[: self.config.eval.rows], store.folder, "val")
        if self.processes.is_main:
            used = ", ".join(f"{s.folder} ({min(len(s), self.config.eval.rows)} rows)" for s in self.validation)
            print(f"Validation: {used}." if used else "Validation: none (data.validation is empty).")

    def _layers(self):
        return [m for m in self.model.modules() if type(m).__name__.endswith("DecoderLayer")]

    # ------------------------------------------------------------ one step

    def _bf16(self, precision: str) -> bool:
        return precision == "bf16" or (precision == "auto" and self.processes.device.type == "cuda")

    def _autocast(self, precision: str | None = None):
        if self._bf16(precision or self.config.precision):
            return torch.autocast(self.processes.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _micro_batch_loss(self, rows: torch.Tensor, num_steps: tuple[int, int], first_row: int, parts: dict):
        """The training objective of one micro-batch, its terms added to `parts`."""
        # The initial state s_0 is random: seed it from the micro-batch's place in the global data order.
        torch.manual_seed(mixed_seed(self.config.seed, first_row))
        rows = rows.to(self.processes.device, non_blocking=True)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        healing = self.healing.active
        kwargs = {"num_steps": num_steps} if self.recurrent else {}
        if healing and self.healing.supervise is not None:
            kwargs["readout_steps"] = self.healing.readout_steps(num_steps)
        with self._autocast():
            output = self.wrapped(input_ids=inputs, **kwargs)
            teacher = self.teacher.logits(inputs) if healing and self.teacher is not None else None
        if not healing:
            return cross_entropy(output.logits, targets)
        return self.healing([*(output.get("readout_logits") or ()), output.logits], targets, teacher, parts)

    def train_step(self) -> dict:
        config, processes, counters = self.config, self.processes, self.counters
        step = counters.step
        depths = self._depths(step)  # {first row in the global batch: (rows, (n, k))}
        started = time.perf_counter()
        batch_start = self.stream.position
        rows = self.stream.next_batch(config.batch.global_, processes.rank, processes.world)
        micro = config.batch.micro
        chunks = rows.split(micro)
        share = rows.shape[0]
        total_loss = torch.zeros((), device=processes.device)
        totals = {}  # the objective's terms (ce, kl, …), averaged like the loss
        for index, chunk in enumerate(chunks):
            offset = processes.rank * share + index * micro
            with processes.accumulating(self.wrapped, index == len(chunks) - 1):
                num_steps = depths.get(offset, depths[0])[1]
                parts = {}
                loss = self._micro_batch_loss(chunk, num_steps, batch_start + offset, parts)
                (loss * chunk.shape[0] / share).backward()
            total_loss += loss.detach() * chunk.shape[0] / share
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + value * chunk.shape[0] / share
        loss = processes.mean(total_loss).item()
        terms = {name: processes_mean_float(processes, value) for name, value in totals.items()}
        grad_norm = global_grad_norm(self.model.parameters(), config.optimizer.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        optimizer_started = time.perf_counter()
        if finite or config.nonfinite == "apply":
            for optimizer in self.optimizers:
                optimizer.step()
            counters.bad_in_row = 0
        else:
            counters.skipped += 1
            counters.bad_in_row += 1
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        lrs = [scheduler.get_last_lr()[0] for scheduler in self.schedulers]  # the LRs this step used
        for scheduler in self.schedulers:
            scheduler.step()
        if processes.device.type == "cuda":
            torch.cuda.synchronize()
        ended = time.perf_counter()
        times = {"seconds": ended - started, "optimizer_s": ended - optimizer_started}
        return {**self._account(step, depths, loss, grad_norm, finite, times, lrs), **terms}

    def _depths(self, step: int) -> dict[int, tuple[int, tuple[int, int]]]:
        """The step's depth as {0: (global rows, (n, k))}; with `depth.draw: micro_batch`, one per micro-batch
        of the global batch, keyed by its first row whatever the process count (2 processes compute what 1 does)."""
        global_rows = self.config.batch.global_
        if not self.recurrent:
            return {0: (global_rows, (0, 1))}
        if self.config.depth.draw == "step":
            return {0: (global_rows, self.schedule.at(step))}
        share, micro = global_rows // self.processes.world, self.config.batch.micro
        return {
            rank * share + start: (min(micro, share - start), self.schedule.at(step, rank * share + start))
            for rank in range(self.processes.world)
            for start in range(0, share, micro)
        }

    def _account(self, step, depths, loss, grad_norm, finite, times, lrs) -> dict:
        counters, config = self.counters, self.config
        tokens = config.batch.global_ * self.stream.seq_len
        mean_depth = self.schedule.mean_depth(step)
        counters.step += 1
        counters.tokens += tokens
        counts = self.parameter_counts
        step_flops = self.stream.seq_len * sum(
            rows * (training_flops_per_token(counts, depth) + self.healing.readout_flops_per_token(counts, depth))
            for rows, depth in depths.values()
        )
        num_steps = depths[0][1]
        counters.flops += step_flops
        if self.teacher is not None:
            counters.flops_teacher += tokens * self.teacher.flops_per_token
        # As the paper's figures count: the authors' ramp, no adapter or final norm (accounting.paper_training_flops).
        paper_depth = paper_accounting_depth(config, step)
        counters.flops_paper += tokens * paper_flops_per_token(self.parameter_counts, *paper_depth)
        peak = peak_flops(self.processes.device)
        record = {
            "kind": "train",
            "step": counters.step,
            "loss": loss,
            "lr": lrs[-1],
            "n": num_steps[0],
            "k": num_steps[1],
            "mean_recurrence": sum(mean_depth),
            "backprop_depth": self.schedule.backprop_depth.at(step),
            "tokens": counters.tokens,
            "flops": counters.flops,
            "flops_paper": counters.flops_paper,
            **({"flops_teacher": counters.flops_teacher} if self.teacher is not None else {}),
            "tokens_per_s": tokens / times["seconds"],
            "grad_norm": grad_norm,
            "phase": self.stream.phase,
            "skipped": counters.skipped,
            **times,  # the step's wall time, and the optimizer step's part of it (clipped gradients to zeroed)
        }
        if len(depths) > 1:  # one draw per micro-batch: n and k above are the first one's
            record["depths"] = [list(depth) for _, depth in depths.values()]
        if len(self.optimizers) > 1:
            record["muon_lr"] = lrs[0]
        if peak:
            record["mfu"] = step_flops / times["seconds"] / (peak * self.processes.world)
        if counters.bad_in_row >= config.max_bad_steps:
            raise RecurfitError(
                f"Step {counters.step}: {counters.bad_in_row} non-finite losses or gradients in a row; stopping. "
                "Lower optimizer.lr / optimizer.muon_lr, or check the data and precision."
            )
        if not finite and self.processes.is_main:
            done = "update skipped" if config.nonfinite == "skip" else "update applied (nonfinite: apply)"
            print(f"step {counters.step}: non-finite loss or gradient, {done} ({counters.skipped} skipped so far)")
        return record

    # ------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict | None:
        """Mean validation loss per store and test recurrence (the parent: once, recurrence does not apply).

        The rows are split into micro-batches and the micro-batches shared out over the processes; each is read
        out at every test recurrence in one pass through the core (its largest r, not their sum)."""
        if not self.validation:
            return None
        self.model.eval()
        record = {"kind": "eval", "step": self.counters.step}
        depths = sorted(set(self.config.eval.steps)) if self.recurrent else [1]
        with self.processes.gathered():  # processes may run different numbers of micro-batches
            for store in self.validation:
                rows = torch.from_numpy(store[: self.config.eval.rows].astype("int64"))  # not empty: _check_validation
                chunks = rows.split(self.config.batch.micro)
                totals = torch.zeros(len(depths) + 1, device=self.processes.device)  # summed losses, micro-batches
                for index in range(self.processes.rank, len(chunks), self.processes.world):
                    totals[:-1] += self._validation_losses(chunks[index], depths, index)
                    totals[-1] += 1
                totals = self.processes.sum(totals)
                for r, loss in zip(depths, (totals[:-1] / totals[-1]).tolist()):
                    record[f"{store.folder.name}/loss" + (f"@{r}" if self.recurrent else "")] = loss
        self.model.train()
        return record

    def _validation_losses(self, rows: torch.Tensor, depths: list[int], index: int) -> torch.Tensor:
        """The next-token CE of `rows` after each of `depths` recurrences (increasing), from one forward whose
        s_0 is seeded from the micro-batch's `index` (the same on any number of processes)."""
        torch.manual_seed(mixed_seed(self.config.seed, index))
        rows = rows.to(self.processes.device, non_blocking=True)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        kwargs = {"num_steps": (0, depths[-1]), "readout_steps": depths[:-1]} if self.recurrent else {}
        with self._autocast(self.config.eval.precision):
            output = self.model(input_ids=inputs, **kwargs)
        logits = [*(output.get("readout_logits") or ()), output.logits]
        return torch.stack([cross_entropy(each, targets) for each in logits]).float()

    # ------------------------------------------------------------ checkpoints

    @contextmanager
    def _timed(self, what: str):
        """Log how long saving `what` (checkpoint, snapshot, final) took, all processes waiting included."""
        started = time.perf_counter()
        yield
        self._write(
            {"kind": "save", "step": self.counters.step, "what": what, "seconds": time.perf_counter() - started}
        )

    def checkpoint(self) -> None:
        with self._timed("checkpoint"):
            self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        model_state, optimizer_states = gather_state(self.model, self.optimizers)
        if self.processes.is_main:
            trainer = {
                "counters": vars(self.counters),
                "stream": self.stream.state_dict(),
                "config": self.config.to_dict(),
            }
            write_checkpoint(
                self.out / "checkpoints",
                self.counters.step,
                model_state,
                optimizer_states,
                self.schedulers,
                trainer,
                self.config.checkpoint.keep,
            )
        self.processes.barrier()

    def _resume(self) -> None:
        """Continue from the newest readable checkpoint; with none yet, start from step 0 in the same folder."""
        checkpoint = self._newest_checkpoint(self.folder.checkpoints)
        if checkpoint is None:
            self._say(f"--resume: {self.out} holds no checkpoint yet; starting from step 0.")
            return
        changed = changed_settings(checkpoint.trainer["config"], self.config.to_dict())
        if changed:
            key = changed[0]
            raise RecurfitError(
                f"--resume: {key} differs from the run's ({', '.join(changed)} changed since {checkpoint.folder}); "
                f"resume with the run's own settings, `recurfit train {self.out / 'config.yaml'} --resume`, "
                "or start a new run (--force, or another out=)."
            )
        trainer = restore(checkpoint, self.model, self.optimizers, self.schedulers)
        self.counters = Counters(**trainer["counters"])
        self.stream.load_state_dict(trainer["stream"])
        self._say(f"Resuming {self.out} from step {self.counters.step} ({checkpoint.folder}).")

    def _newest_checkpoint(self, root: Path) -> Checkpoint | None:
        """`newest_readable`, verified once: the main process hashes the files and chooses, the others read the
        checkpoint it chose (a 1B model's is ~12 GB: hashing it on every process would multiply the wait)."""
        chosen, problem = None, None
        if self.processes.is_main:
            try:
                chosen = newest_readable(root, warn=self._say)
            except RecurfitError as error:
                problem = str(error)
        folder, problem = self.processes.broadcast((chosen and chosen.folder, problem))
        if problem is not None:  # every process stops, none waits for the others
            raise RecurfitError(problem)
        if chosen is None and folder is not None:
            chosen = read_checkpoint(folder, warn=self._say, verify=False)
        return chosen

    def _carry_state(self) -> None:
        """model.carry_state: the optimizer state and data position of the run this one continues; with
        model.continue_schedule also its step count, so that the schedules and depth draws go on from there."""
        continuing = self.config.model.continue_schedule
        setting = "model.continue_schedule" if continuing else "model.carry_state"
        source = RunFolder(Path(self.config.model.init_from))
        checkpoint = self._newest_checkpoint(source.checkpoints)
        if checkpoint is None:
            raise RecurfitError(f"{setting}: {source.path} has no checkpoint to carry the state from.")
        check_carry(checkpoint.trainer["config"], self.config)
        if continuing:
            check_continuation(source.path, checkpoint.trainer["config"], checkpoint.step, self.config.to_dict())
        carry_optimizer_states(checkpoint, self.model, self.optimizers, shared_only=continuing)
        try:
            self.stream.load_state_dict(checkpoint.trainer["stream"])
        except RecurfitError:
            raise RecurfitError(
                f"{setting} continues the data stream of {source.path}, which read other data: give the "
                f"same data.phases sources and seed, or drop {setting}."
            ) from None
        if continuing:
            self.counters = Counters(**{**checkpoint.trainer["counters"], "bad_in_row": 0})
            self.start_step = self.counters.step
            advance(self.schedulers, self.start_step)

    def _say(self, message: str | None) -> None:
        if message is not None and self.processes.is_main:
            print(message)

    def training_record(self) -> dict:
        """Where training stands: what a snapshot's and the final model's `training.json` hold, so an evaluation
        over training can place each model on the paper's axes (tokens, both FLOPs measures)."""
        counters = self.counters
        return {
            "run": self.out.name,
            "step": counters.step,
            "steps": self.config.steps,
            "tokens": counters.tokens,
            "flops": counters.flops,
            "flops_paper": counters.flops_paper,
            "flops_teacher": counters.flops_teacher,  # distillation's teacher forwards (0 without), not in either
            "mean_recurrence": self.config.depth.mean_recurrence if self.recurrent else None,
            "recurrent": self.recurrent,
            "earlier": self.earlier,  # the runs this one continues (model.init_from): not in the counters above
        }

    def _save_model(
        self, target: Path, card_validation: dict | None = None, card: bool = False, dtype: str = "float32"
    ) -> None:
        """The model as a `from_pretrained` folder, with its tokenizer and `training.json`, written atomically
        (collective under FSDP: every rank gathers, the main one writes); its floating-point weights in `dtype`."""
        model = merged(self.model)  # LoRA adapters merged: the folder loads as a plain recurfit model
        model_state, _ = gather_state(model, [])
        if self.processes.is_main:
            with staged_directory(target, replace=True) as staging:
                save_weights(model, staging, model_state, dtype)
                if self.tokenizer is not None:
                    save_tokenizer(self.tokenizer, staging)
                record = self.training_record()
                (staging / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
                if card:
                    training = {"config": self.config.to_dict(), **record, "steps": record["step"]}
                    cells = (card_validation["step"], *validation_columns(card_validation)) if card_validation else None
                    write_model_card(staging, model, self.out.name, training, cells)
        self.processes.barrier()

    def export(self, validation: dict | None = None) -> Path:
        """The final model as a `from_pretrained` folder (with the tokenizer when the model had one) and its model
        card: the recipe, the tokens and the last `validation` record."""
        final = self.out / "final"
        with self._timed("final"):
            self._save_model(final, validation, card=True)
        return final

    def snapshot(self) -> None:
        """A loadable model of this step under OUT/snapshots (weights only: the resumable state is a checkpoint's),
        in `snapshots.dtype`."""
        with self._timed("snapshot"):
            target = self.folder.snapshots / f"step-{self.counters.step:06d}"
            self._save_model(target, dtype=self.config.snapshots.dtype)

    def _announce_snapshots(self) -> None:
        """What the snapshots will take on disk, said before the first one is written."""
        every = self.config.snapshots.every
        if not every:
            return
        # At the start and every `every` steps before the end, which is final/.
        start, end = self.start_step, self.config.end
        count = 1 + (end - 1) // every - start // every if end > start else 0
        floating = getattr(torch, self.config.snapshots.dtype).itemsize
        size = sum(
            t.numel() * (floating if t.is_floating_point() else t.element_size())
            for t in {p.data_ptr(): p for p in self.model.state_dict().values()}.values()
        )
        self._say(
            f"Snapshots: every {every} steps, {count} × {size_text(size)} = {size_text(count * size)} "
            f"in {self.folder.snapshots}."
        )

    # ------------------------------------------------------------ the run

    def run(self) -> TrainResult:
        config, counters = self.config, self.counters
        result = TrainResult(self.out, counters)
        show = config.log.progress and self.processes.is_main
        with progress_bar(TextColumn("{task.fields[status]}"), disable=not show) as bar:
            mean = self.schedule.mean_recurrence.at(counters.step)
            first = f"step {counters.step + 1}: first forward and backward (r̄ {mean})"
            task = bar.add_task("training", total=config.end, completed=counters.step, status=first)
            if config.snapshots.every and counters.step == self.start_step:
                self.snapshot()  # the model before training: the curves' first point
            while counters.step < config.end:
                record = self.train_step()
                result.losses.append(record["loss"])
                loss, mean, rate = record["loss"], record["mean_recurrence"], record["tokens_per_s"]
                status = f"loss {loss:.4f}  r̄ {mean}  {rate:,.0f} tok/s"
                bar.update(task, advance=1, status=status)
                step = counters.step
                if self.log is not None and (step % config.log.every == 0 or step == config.end):
                    self.log.write(record)
                if config.eval.every and step % config.eval.every == 0 and step < config.end:
                    self._write(self.validate())
                if config.snapshots.every and step % config.snapshots.every == 0 and step < config.end:
                    self.snapshot()
                if config.checkpoint.every and step % config.checkpoint.every == 0 and step < config.end:
                    self.checkpoint()
        if self.resumed_at < config.end:
            result.validation = self.validate()
            self._write(result.validation)
            self.checkpoint()
        else:  # resumed from the last checkpoint, which follows the final validation: only the export is left
            result.validation = next(
                (r for r in reversed(read_log(self.out)) if r["kind"] == "eval" and r["step"] == config.end), None
            )
        self.export(result.validation)
        self.close()
        return result

    def close(self) -> None:
        """Close the log and give up the run folder."""
        if self.log is not None:
            self.log.close()
            self.log = None
        self.ownership.close()

    def _write(self, record: dict | None) -> None:
        if record is not None and self.log is not None:
            self.log.write(record)


def save_weights(model, folder: Path, state: dict, dtype: str) -> None:
    """`model.save_pretrained(folder)` with `state`'s floating-point tensors in `dtype`, and config.json saying so
    (transformers writes the model's own dtype there)."""
    if dtype != "float32":
        state = {name: t.to(getattr(torch, dtype)) if t.is_floating_point() else t for name, t in state.items()}
    model.save_pretrained(folder, state_dict=state)
    settings = json.loads((folder / "config.json").read_text())
    if settings.get("dtype", dtype) != dtype:
        settings["dtype"] = dtype
        (folder / "config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def processes_mean_float(processes: Processes, value: torch.Tensor) -> float:
    return processes.mean(value.detach().float()).item()


def train(config: TrainConfig, resume: bool = False, force: bool = False) -> TrainResult:
    """Run (`resume`: continue, `force`: start over) the training `config` describes; returns the counters and
    this run's losses. See `run_folder.py` for what each does with the folder's earlier run."""
    finished = already_finished(config, resume, force)
    if finished is not None:
        return finished
    trainer = Trainer(config, resume=resume, force=force)
    try:
        return trainer.run()
    finally:
        trainer.close()


def already_finished(config: TrainConfig, resume: bool, force: bool) -> TrainResult | None:
    """With `resume`, a finished run is left as it is: its result, marked `already_finished` (None otherwise)."""
    folder = RunFolder(Path(config.out))
    folder.check_flags(resume, force)
    if resume and folder.finished:
        return TrainResult(folder.path, Counters(step=folder.last_step() or config.end), already_finished=True)
    return None

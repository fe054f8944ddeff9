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

import math
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import TextColumn

from ..data import Phase, RowStream, TokenStore
from ..data.store import check_tokenizer
from ..errors import RecurfitError
from ..io.lock import owned
from ..model.accounting import count_parameters
from ..model.loading import optional_tokenizer
from ..model.sampling import mixed_seed
from ..progress import progress_bar
from .config import TrainConfig
from .counting import Counters, count_step, step_flops
from .distributed import Processes, fill_from_main
from .head import final_hidden_states, head_losses
from .initial_model import initial_model, is_recurrent
from .losses import HealingLoss, Teacher, describe, micro_batch_weights
from .metrics import MetricsLog, peak_flops, read_log
from .optim import BatchedMuon, build_optimizers, build_schedulers, global_grad_norm, trains_in_bf16
from .parts import decoder_layers, trained_parts_line
from .run_folder import RunFolder, earlier_training
from .saving import Saving
from .step_plan import StepPlan, depth_schedule, plan_step
from .validation_loss import depth_losses, validation_record


@dataclass
class TrainResult:
    out: Path
    counters: Counters
    losses: list[float] = field(default_factory=list)  # per step run in this process (not the resumed prefix)
    already_finished: bool = False  # --resume of a finished run: nothing was done
    validation: dict | None = None  # the final validation record (store/loss@r: loss), if the run validates


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, averaged over all processes."""

    loss: float
    terms: dict[str, float]  # the objective's terms (ce, kl, …), averaged like the loss
    grad_norm: float
    finite: bool  # loss and gradient: a non-finite step's update is skipped (nonfinite: skip)
    lrs: list[float]  # the learning rates the step used, one per optimizer
    seconds: float  # the step's wall time
    optimizer_s: float  # of which the optimizer's part (clipped gradients to zeroed)


class Trainer(Saving):
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
        self.model, built = initial_model(config, self.processes)  # the meta device's, or placed
        self.tokenizer = optional_tokenizer(config.model.source)  # saved with every snapshot and the final model
        self._say(trained_parts_line(self.model, config))
        self.recurrent = is_recurrent(self.model)
        self.parameter_counts = count_parameters(self.model)
        self.stream = RowStream(
            [Phase({s.path: s.weight for s in p.sources}, p.tokens) for p in config.data.phases],
            seed=config.seed,
            vocab_size=self.model.config.vocab_size,
            masks=config.data.assistant_only_loss,
        )
        self.validation = [TokenStore(path, "val") for path in config.data.validation]
        self._check_vocabulary()
        self._check_validation()
        self.schedule = depth_schedule(config)
        self.earlier = earlier_training(config.model.init_from, continued=config.model.continue_schedule)
        if compiles_training(config.compile, self.processes.device.type):
            for layer in decoder_layers(self.model):
                layer.compile()
        on_meta = next(self.model.parameters()).is_meta
        if on_meta and config.distributed == "ddp":
            fill_from_main(self.model, built, self.processes)  # placed; wrapping it sends the main one's weights
        self.wrapped = self.processes.wrap(
            self.model,
            config.distributed,
            bf16=self._bf16(config.precision),
            layers=config.fsdp_units == "layer",
            shard_size=config.fsdp_shard_size,
        )
        if on_meta and config.distributed == "fsdp":
            fill_from_main(self.model, built, self.processes)  # sharded, then each process's shards sent
        del built
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
        more_rows = (config.end - self.counters.step) * config.batch.global_
        self._say(self.stream.repeat_warning(more_rows, config.data.repeat))  # or, refused, the old run stays
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
        """The log's first record of each (re)start: what ran where, in which precision, and the precision Muon
        orthogonalises in."""
        device = self.processes.device
        record = {"kind": "start", "step": self.counters.step, "torch": torch.__version__, "device": str(device)}
        record["processes"] = self.processes.world
        if self.teacher is not None:
            record["distill"] = {**self.config.to_dict()["distill"], "teacher": self.teacher.name}
        if self.healing.supervise is not None:
            record["depth_supervision"] = self.config.to_dict()["depth"]["supervise"]
        if device.type == "cpu":
            record["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        record["precision"] = "bf16" if self._bf16(self.config.precision) else "fp32"
        if self.config.precision == "auto" and device.type == "cpu":
            native = "has" if record["precision"] == "bf16" else "has no"
            self._say(
                f"Forward and backward in {record['precision']} (auto: this CPU ({record['cpu_capability']}) "
                f"{native} native bf16 matmul)."
            )
        record["compiled"] = compiles_training(self.config.compile, device.type)
        if self.config.compile == "auto":
            where = f"auto: {'a GPU' if device.type == 'cuda' else f'no GPU ({device.type})'}"
            self._say(f"Decoder layers {'compiled' if record['compiled'] else 'eager'} ({where}).")
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
            check_tokenizer(store.folder, store.meta, self.tokenizer)
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
            print(f"Validation: {used}." if used else "Validation: none (data.validation is empty).", file=sys.stderr)

    # ------------------------------------------------------------ one step

    def _bf16(self, precision: str) -> bool:
        return trains_in_bf16(precision, self.processes.device.type)

    def _autocast(self, precision: str | None = None):
        if self._bf16(precision or self.config.precision):
            return torch.autocast(self.processes.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self) -> dict:
        """One optimizer step: plan, forward and backward, clip, update (or skip), count; its log record."""
        plan = self._plan(self.counters.step)
        started = time.perf_counter()
        loss, terms = self._forward_backward(plan)
        grad_norm = global_grad_norm(self.model.parameters(), self.config.optimizer.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        optimizer_started = time.perf_counter()
        self._update_or_skip(finite)
        lrs = self._next_learning_rates()
        if self.processes.device.type == "cuda":
            torch.cuda.synchronize()
        ended = time.perf_counter()
        result = StepResult(loss, terms, grad_norm, finite, lrs, ended - started, ended - optimizer_started)
        flops = step_flops(plan, self.parameter_counts, self.stream.seq_len, self.healing.readout_flops_per_token)
        teacher = self.teacher.flops_per_token if self.teacher is not None else None
        tokens = count_step(
            self.counters, self.config, plan, self.parameter_counts, self.stream.seq_len, flops, teacher
        )
        return self._step_record(plan, result, tokens, flops)

    def _plan(self, step: int) -> StepPlan:
        return plan_step(self.config, self.schedule, step, self.processes.world, self.recurrent)

    def _forward_backward(self, plan: StepPlan) -> tuple[float, dict[str, float]]:
        """This process's share of the global batch, micro-batch by micro-batch, gradients accumulated; the loss
        and its terms averaged over all processes."""
        processes, micro = self.processes, self.config.batch.micro
        batch_start = self.stream.position
        rows, masks = self.stream.next_rows(self.config.batch.global_, processes.rank, processes.world)
        chunks = rows.split(micro)
        share = rows.shape[0]
        weights = micro_batch_weights(share, masks, micro, processes)  # each one's share of the counted targets
        targets_masks = masks[:, 1:].split(micro) if masks is not None else [None] * len(chunks)
        total_loss = torch.zeros((), device=processes.device)
        totals = {}  # the objective's terms, weighted by rows as the loss
        for index, chunk in enumerate(chunks):
            first_row = processes.rank * share + index * micro  # in the global batch
            num_steps = plan.at_row(first_row).num_steps
            with processes.accumulating(self.wrapped, index == len(chunks) - 1):
                terms = {}
                loss = self._micro_batch_loss(chunk, num_steps, batch_start + first_row, terms, targets_masks[index])
                (loss * weights[index]).backward()
            total_loss += loss.detach() * weights[index]
            for name, value in terms.items():
                totals[name] = totals.get(name, 0.0) + value * weights[index]
        terms = {name: processes.mean(value.detach().float()).item() for name, value in totals.items()}
        return processes.mean(total_loss).item(), terms

    def _micro_batch_loss(self, rows: torch.Tensor, num_steps: tuple[int, int], first_row: int, terms: dict, mask=None):
        """The training objective of one micro-batch, its terms added to `terms`; with `mask` (1 per target the
        loss counts: data.assistant_only_loss), the mean over those targets alone."""
        # The initial state s_0 is random: seed it from the micro-batch's place in the global data order.
        torch.manual_seed(mixed_seed(self.config.seed, first_row))
        rows = rows.to(self.processes.device, non_blocking=True)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        if mask is not None:
            mask = mask.to(self.processes.device, non_blocking=True).flatten().bool()
        healing = self.healing.active
        kwargs = {"num_steps": num_steps} if self.recurrent else {}
        if healing and self.healing.supervise is not None:
            kwargs["readout_steps"] = self.healing.readout_steps(num_steps)
        with self._autocast():
            hidden, weight = final_hidden_states(self.wrapped, self.model, inputs, **kwargs)
            if not healing:
                return head_losses(hidden[-1], weight, targets, mask=mask)[0]
            teacher = self.teacher.hidden_states(inputs) if self.teacher is not None else None
            return self.healing(hidden, weight, targets, teacher, terms, mask)

    def _update_or_skip(self, finite: bool) -> None:
        """Apply the update, or skip it for a non-finite loss or gradient (`nonfinite: skip`), stopping the run
        after `max_bad_steps` skips in a row; then zero the gradients."""
        counters, config = self.counters, self.config
        if finite or config.nonfinite == "apply":
            for optimizer in self.optimizers:
                optimizer.step()
            counters.bad_in_row = 0
        else:
            counters.skipped += 1
            counters.bad_in_row += 1
            if counters.bad_in_row >= config.max_bad_steps:
                raise RecurfitError(
                    f"Step {counters.step + 1}: {counters.bad_in_row} non-finite losses or gradients in a row; "
                    "stopping. Lower optimizer.lr / optimizer.muon_lr, or check the data and precision."
                )
        if not finite and self.processes.is_main:
            done = "update skipped" if config.nonfinite == "skip" else "update applied (nonfinite: apply)"
            print(
                f"step {counters.step + 1}: non-finite loss or gradient, {done} ({counters.skipped} skipped so far)",
                file=sys.stderr,
            )
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _next_learning_rates(self) -> list[float]:
        """Advance the LR schedules; the learning rates this step used."""
        lrs = [scheduler.get_last_lr()[0] for scheduler in self.schedulers]
        for scheduler in self.schedulers:
            scheduler.step()
        return lrs

    def _step_record(self, plan: StepPlan, result: StepResult, tokens: int, flops: float) -> dict:
        """The log's `train` record of the step just counted."""
        counters = self.counters
        record = {
            "kind": "train",
            "step": counters.step,
            "loss": result.loss,
            "lr": result.lrs[-1],
            "n": plan.first.n,  # one draw per micro-batch: the first one's, all of them under `depths`
            "k": plan.first.k,
            "mean_recurrence": sum(self.schedule.mean_depth(plan.step)),
            "backprop_depth": self.schedule.backprop_depth.at(plan.step),
            "tokens": counters.tokens,
            "flops": counters.flops,
            "flops_paper": counters.flops_paper,
            **({"flops_teacher": counters.flops_teacher} if self.teacher is not None else {}),
            "tokens_per_s": tokens / result.seconds,
            "grad_norm": result.grad_norm,
            "phase": self.stream.phase,
            "skipped": counters.skipped,
            "seconds": result.seconds,
            "optimizer_s": result.optimizer_s,
        }
        if plan.per_micro_batch:
            record["depths"] = [list(batch.num_steps) for batch in plan.micro_batches]
        if len(self.optimizers) > 1:
            record["muon_lr"] = result.lrs[0]
        peak = peak_flops(self.processes.device)
        if peak:
            record["mfu"] = flops / result.seconds / (peak * self.processes.world)
        return {**record, **result.terms}

    # ------------------------------------------------------------ validation

    def validate(self) -> dict | None:
        """The `eval` record of this step (`validation_loss.validation_record`); None without validation stores."""
        return validation_record(
            self.model, self.validation, self.config, self.processes, self.counters.step, self.recurrent, self._autocast
        )

    def _validation_losses(self, rows: torch.Tensor, depths: list[int], index: int) -> torch.Tensor:
        """The CE of `rows` after each of `depths` recurrences, as validation reads it (`depth_losses`)."""
        return depth_losses(
            self.model, rows, depths, index, self.config, self.processes, self.recurrent, self._autocast
        )

    def _say(self, message: str | None) -> None:
        if message is not None and self.processes.is_main:
            print(message, file=sys.stderr)  # progress: stderr (a command's results go to stdout)

    # ------------------------------------------------------------ the run

    def run(self) -> TrainResult:
        config, counters = self.config, self.counters
        result = TrainResult(self.out, counters)
        show = config.log.progress and self.processes.is_main
        with progress_bar(TextColumn("{task.fields[status]}"), disable=not show) as bar:
            first = f"step {counters.step + 1}: first forward and backward"
            if self.recurrent:  # a fixed-depth model (the parent) has no recurrence to show
                first += f" (r̄ {self.schedule.mean_recurrence.at(counters.step)})"
            task = bar.add_task("training", total=config.end, completed=counters.step, status=first)
            if config.snapshots.every and counters.step == self.start_step:
                self.snapshot()  # the model before training: the curves' first point
            while counters.step < config.end:
                record = self.train_step()
                result.losses.append(record["loss"])
                depth = f"  r̄ {record['mean_recurrence']}" if self.recurrent else ""
                status = f"loss {record['loss']:.4f}{depth}  {record['tokens_per_s']:,.0f} tok/s"
                bar.update(task, advance=1, status=status)
                step = counters.step
                if self.log is not None and (step % config.log.every == 0 or step == config.end):
                    self.log.write(record)
                if config.eval.due(step) and step < config.end:
                    self._write(self.validate())
                if config.snapshots.every and step % config.snapshots.every == 0 and step < config.end:
                    self.snapshot()
                if config.checkpoint.every and step % config.checkpoint.every == 0 and step < config.end:
                    self.checkpoint()
        if self.resumed_at < config.end:
            self.checkpoint()
        self.export()  # the checkpoint and final model first: a failing final validation loses neither
        result.validation = self._final_validation()
        self.close()
        return result

    def _final_validation(self) -> dict | None:
        """The final validation record, added to the final model's card. A resumed run whose log already holds it
        (it was killed while exporting) does not validate again."""
        end, record = self.config.end, None
        if self.resumed_at >= end:  # resumed after the final checkpoint: the log may hold the final validation
            logged = read_log(self.out) if self.processes.is_main else []
            record = self.processes.broadcast(
                next((r for r in logged if r["kind"] == "eval" and r["step"] == end), None)
            )
        if record is None:
            try:
                record = self.validate()
            except BaseException:
                final = self.out / "final"
                self._say(f"The final validation failed; the final model is saved: `recurfit eval loss {final}`.")
                raise
            self._write(record)
        if record is not None:
            self.write_card(self.out / "final", record)
        return record

    def close(self) -> None:
        """Close the log and give up the run folder."""
        if self.log is not None:
            self.log.close()
            self.log = None
        self.ownership.close()

    def _write(self, record: dict | None) -> None:
        if record is not None and self.log is not None:
            self.log.write(record)


def compiles_training(choice, device_type: str) -> bool:
    """Whether training compiles each decoder layer (`compile`): `auto` compiles on a GPU, where a compiled step
    trains faster than an eager one (docs/results/gpu.md), and runs eagerly on a CPU, where compiling is slow and
    a run is short."""
    return device_type == "cuda" if choice == "auto" else bool(choice)


def train(config: TrainConfig, resume: bool = False, force: bool = False) -> TrainResult:
    """Run (`resume`: continue, `force`: start over) the training `config` describes; returns the counters and
    this run's losses. See `run_folder.py` for what each does with the folder's earlier run."""
    with Processes.from_environment(config.distributed_timeout) as processes:
        finished = processes.agree(already_finished, config, resume, force)  # the main process's view of the folder
        return finished if finished is not None else _run(config, resume, force, processes)


def _run(config: TrainConfig, resume: bool, force: bool, processes: Processes) -> TrainResult:
    """The run, with its trainer (model, optimizers) freed on return: before `train` destroys the group."""
    trainer = Trainer(config, resume=resume, force=force, processes=processes)
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

"""Run by tests/test_train_distributed.py, under `torchrun --nproc-per-node 2` and alone: what one process does.

`python distributed_probe.py MODE CONFIG.yaml OUT.json` builds the trainer of CONFIG and writes, per process
(OUT.json.RANK), with MODE
- `steps`: `validation`, the validation record and how many forwards validation ran in this process; under
  FSDP2, `collectives`, its all-gathers and reduce-scatters during one training step at each (n, k) of DEPTHS;
- `numerics`: `dtypes`, the dtype of the hidden states the first prelude layer, the adapter and the first core
  layer receive in one training step, and `losses`, the losses of that step and 3 more;
- `resume`: `hashed`, the files this process hashed to resume the run, and the `step` it resumed at;
- `weights` (and `weights-alone`: every process builds the whole model itself, as one process does):
  `peak_host_bytes`, this process's peak resident set (VmHWM) once the trainer is set up, over its resident set
  before; the main process writes the set-up model's weights (gathered) to OUT.safetensors, and each
  process its buffers (RoPE's frequencies among them, which no state dict holds) to OUT.buffers.RANK;
- `teacher`: the distillation teacher alone, set up as training sets it up: `loads`, how often this process loaded
  its weights; `sharded`, whether every teacher parameter is still a shard (a DTensor holding a part of the tensor)
  after a forward; the main process writes the logits the loss reads from the teacher (its hidden states through
  its head's weight) at fixed inputs, and the unsharded teacher's logits there, to OUT.safetensors;
and in every mode `threads_after_close`, the names of the process's threads once its process group is closed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from recurfit.train import Trainer, load_config
from recurfit.train.distributed import Processes
from recurfit.train.step_plan import MicroBatch, StepPlan

DEPTHS = [(1, 1), (6, 3)]  # one step at each: the collectives must not depend on n + k
UNEVEN = [(0, 1), (28, 4)]  # then one step at r = 1 on the first process and r = 32 on the second


class Counter:
    """Counts calls of `owner.name` (a function FSDP2 looks up in its module each time it communicates)."""

    def __init__(self, owner, name: str):
        self.count, original = 0, getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)


def collectives(trainer: Trainer) -> dict:
    """Per (n, k) of DEPTHS, one training step's [all-gathers, reduce-scatters], and the same for a step at this
    process's depth of UNEVEN (`uneven`); and `orthogonalised`, the
    matrices this process's Muon orthogonalised in those steps, against the `units` it updates per step."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    from recurfit.train import optim

    gathers, reductions = Counter(group, "foreach_all_gather"), Counter(group, "foreach_reduce")
    orthogonalised, newton_schulz = [], optim.newton_schulz
    optim.newton_schulz = lambda batch, *args: orthogonalised.append(batch.shape[0]) or newton_schulz(batch, *args)
    counts = {}
    steps = [(f"{n},{k}", (n, k)) for n, k in DEPTHS]
    if trainer.config.fsdp_units == "recurrence":  # by layer, the processes draw the same depths
        steps.append(("uneven", UNEVEN[trainer.processes.rank % len(UNEVEN)]))  # a depth per process, far apart
    for key, (n, k) in steps:
        trainer._plan = lambda step, n=n, k=k: StepPlan(step, (MicroBatch(0, trainer.config.batch.global_, n, k),))
        before = gathers.count, reductions.count
        trainer.train_step()
        counts[key] = [gathers.count - before[0], reductions.count - before[1]]
    muon = trainer.optimizers[0]
    counts["orthogonalised"] = sum(orthogonalised)
    body = trainer.model.model
    counts["shape"] = [len(body.prelude), len(body.core), len(body.coda)]
    counts["units"] = sum(len(list(muon._units(group))) for group in muon.param_groups)
    return counts


def validation(trainer: Trainer) -> dict:
    forwards = []
    body = trainer.model.model
    hook = body.register_forward_pre_hook(lambda module, args: forwards.append(1))
    record = trainer.validate()
    hook.remove()
    return {"record": record, "forwards": len(forwards)}


def steps(trainer: Trainer) -> dict:
    result = {"validation": validation(trainer)}
    if trainer.config.distributed == "fsdp" and trainer.processes.grouped:
        result["collectives"] = collectives(trainer)
    return result


def numerics(trainer: Trainer) -> dict:
    body, dtypes = trainer.model.model, {}
    hooks = [
        module.register_forward_pre_hook(
            lambda module, args, name=name: dtypes.setdefault(name, str(args[0].dtype)) and None
        )
        for name, module in (("prelude", body.prelude[0]), ("adapter", body.adapter), ("core", body.core[0]))
    ]
    losses = [trainer.train_step()["loss"] for _ in range(4)]
    for hook in hooks:
        hook.remove()
    return {"dtypes": dtypes, "losses": losses}


def resume(config, processes: Processes) -> dict:
    from recurfit.train import checkpoint

    hashed = Counter(checkpoint, "_sha256")
    trainer = Trainer(config, resume=True, processes=processes)
    trainer.close()
    return {"hashed": hashed.count, "step": trainer.counters.step}


def teacher(config, processes: Processes, out: str) -> dict:
    from safetensors.torch import save_file

    from recurfit.model import loading
    from recurfit.train import losses

    if config.distributed == "fsdp" and processes.grouped:
        processes.mesh = processes.fsdp_mesh(config.fsdp_shard_size)  # as `Processes.wrap` sets it for the student
    loads = Counter(losses, "load_model")
    source, _ = config.distill.source(config.model)
    vocab = loading.load_config(source).vocab_size
    model = losses.Teacher(config.distill, config.model, vocab, processes, config.distributed)
    inputs = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden, weight = model.hidden_states(inputs)
    logits = hidden @ weight.T
    parameters = list(model.model.parameters())
    sharded = all(type(p).__name__ == "DTensor" and p.to_local().numel() < p.numel() for p in parameters)
    result = {"loads": loads.count, "sharded": sharded}
    if processes.is_main:
        whole = loading.load_model(source, dtype=weight.dtype)
        with torch.no_grad():
            expected = whole(input_ids=inputs, use_cache=False).logits.flatten(0, 1)
        save_file({"logits": logits.contiguous(), "unsharded": expected.contiguous()}, f"{out}.safetensors")
    del model, hidden, weight, parameters
    return result


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as file:
        return int(next(line for line in file if line.startswith(field + ":")).split()[1]) * 1024


def weights(config, processes: Processes, out: str, alone: bool) -> dict:
    from safetensors.torch import save_file

    from recurfit.train import loop
    from recurfit.train.checkpoint import _unshared, gather_state
    from recurfit.train.initial_model import build_model
    from recurfit.train.parts import select_parts

    if alone:  # each process builds and places the whole model: what every process did before the meta device
        loop.initial_model = lambda config, processes: (
            select_parts(build_model(config.model, config.depth, config.seed), config).to(processes.device),
            None,
        )
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # the high-water mark starts again at the resident set
    trainer = Trainer(config, processes=processes)
    peak = status("VmHWM") - before
    state, _ = gather_state(trainer.model, [])
    if processes.is_main:
        save_file(_unshared(state), f"{out}.safetensors")
    # Each process's buffers, which no state dict holds (RoPE's inv_freq is not persistent), as its forward reads them
    buffers = {name: buffer.contiguous() for name, buffer in trainer.model.named_buffers()}
    save_file(buffers, f"{out}.buffers.{processes.rank}")
    trainer.close()
    return {"peak_host_bytes": peak}


def run(mode: str, config, processes: Processes, out: str) -> dict:
    """MODE's result; its trainer is freed on return, before `main` destroys the group (`Processes.close`)."""
    if mode == "resume":
        return resume(config, processes)
    if mode == "teacher":
        return teacher(config, processes, out)
    if mode.startswith("weights"):
        return weights(config, processes, out, alone=mode == "weights-alone")
    trainer = Trainer(config, processes=processes)
    result = numerics(trainer) if mode == "numerics" else steps(trainer)
    trainer.close()
    return result


def main(mode: str, config_path: str, out: str) -> None:
    config = load_config(config_path)
    with Processes.from_environment(config.distributed_timeout) as processes:
        result = run(mode, config, processes, out)
    result["threads_after_close"] = thread_names()
    with open(f"{out}.{processes.rank}", "w") as file:
        json.dump(result, file)


def thread_names() -> list[str]:
    """The names of this process's threads (gloo's are `gloo_tcp_loop` and `pt_gloo_runloop`)."""
    tasks = Path("/proc/self/task")
    return sorted((task / "comm").read_text().strip() for task in tasks.iterdir())


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])

"""The run's validation: the mean next-token loss of each validation store's first rows, per test recurrence."""

from __future__ import annotations

import torch

from ..data import TokenStore
from ..model.sampling import mixed_seed
from .config import TrainConfig
from .distributed import Processes
from .head import final_hidden_states, head_losses


@torch.no_grad()
def validation_record(
    model, stores: list[TokenStore], config: TrainConfig, processes: Processes, step: int, recurrent: bool, autocast
) -> dict | None:
    """Mean validation loss per store and test recurrence (the parent: once, recurrence does not apply), as the
    log's `eval` record of `step`; None without validation stores. `autocast(precision)` is the run's autocast.

    The rows are split into micro-batches and the micro-batches shared out over the processes; each is read
    out at every test recurrence in one pass through the core (its largest r, not their sum). Its memory is the
    plan's `validation` term (memory.py)."""
    if not stores:
        return None
    model.eval()
    record = {"kind": "eval", "step": step}
    depths = sorted(set(config.eval.steps)) if recurrent else [1]
    for store in stores:
        rows = torch.from_numpy(store[: config.eval.rows].astype("int64"))  # not empty: _check_validation
        chunks = rows.split(config.batch.micro)
        totals = torch.zeros(len(depths) + 1, device=processes.device)  # summed losses, micro-batches
        for index in processes.deal(len(chunks)):
            losses = depth_losses(model, chunks[index or 0], depths, index or 0, config, processes, recurrent, autocast)
            if index is not None:  # None: a forward whose collectives pair with another process's last share
                totals[:-1] += losses
                totals[-1] += 1
        totals = processes.sum(totals)
        for r, loss in zip(depths, (totals[:-1] / totals[-1]).tolist()):
            record[f"{store.folder.name}/loss" + (f"@{r}" if recurrent else "")] = loss
    processes.reshard()
    model.train()
    return record


def depth_losses(model, rows: torch.Tensor, depths: list[int], index: int, config, processes, recurrent, autocast):
    """The next-token CE of `rows` after each of `depths` recurrences (increasing), from one forward whose
    s_0 is seeded from the micro-batch's `index` (the same on any number of processes). The forward stops at
    the final hidden states of each depth; the head reads them one depth, and one chunk of positions, at a time
    (`head.HeadLoss`): no depth's whole logits exist."""
    torch.manual_seed(mixed_seed(config.seed, index))
    rows = rows.to(processes.device, non_blocking=True)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    kwargs = {"num_steps": (0, depths[-1]), "readout_steps": depths[:-1]} if recurrent else {}
    with autocast(config.eval.precision):
        hidden, weight = final_hidden_states(model, model, inputs, **kwargs)
        return torch.stack([head_losses(each, weight, targets)[0] for each in hidden]).float()

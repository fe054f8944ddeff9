"""Training's validation: one pass per micro-batch read out at every test recurrence, against a forward per r.

    python benchmarks/validation.py [--recurrence 1,2,4,8,16,32] [--rows 64] [--repeats 3]

On train_setup.py's tiny training set-up (a random 16-layer llama retrofitted to (4, 8, 4), sequences of 32),
times `Trainer.validate` (the prelude once, the core max(r) times per micro-batch) and the forward-per-r way
validation ran before (the core Σr times), alternating, best of --repeats, in this one run; checks that both give
the same losses; prints the measured ratio beside the one the layer counts predict,
(P + max(r)·R + |r|·C) / Σ_r (P + r·R + C).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import yaml
from train_setup import prepare_train

from recurfit.train import Trainer, load_config


def forward_per_r(trainer: Trainer, steps: list[int]) -> dict:
    """Validation as it was: every r a forward of its own, from the same s_0 per micro-batch."""
    store = trainer.validation[0]
    rows = torch.from_numpy(store[: trainer.config.eval.rows].astype("int64"))
    chunks = rows.split(trainer.config.batch.micro)
    with torch.no_grad():
        return {
            r: torch.stack([trainer._validation_losses(chunk, [r], i)[0] for i, chunk in enumerate(chunks)]).mean()
            for r in steps
        }


def best_of(repeats: int, function) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recurrence", default="1,2,4,8,16,32")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    steps = [int(r) for r in args.recurrence.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        prepare_train(work, smoke=True)
        config = yaml.safe_load((work / "train.yaml").read_text())
        config["eval"] = {"every": 0, "steps": steps, "rows": args.rows}
        config["batch"] = {"micro": 8, "global": 8}
        trainer = Trainer(load_config(None, base=config))
        trainer.model.eval()
        one_pass, separate = [], []
        for _ in range(args.repeats):  # alternating, so that both see the same machine
            one_pass.append(best_of(1, trainer.validate))
            separate.append(best_of(1, lambda: forward_per_r(trainer, steps)))
        trainer.close()
    (fast, record), (slow, reference) = min(one_pass, key=lambda x: x[0]), min(separate, key=lambda x: x[0])
    for r in steps:
        got, want = record[f"data/loss@{r}"], reference[r].item()
        assert abs(got - want) <= 1e-5 * abs(want), (r, got, want)
    P, R, C = trainer.model.config.shape
    predicted = (P + max(steps) * R + len(steps) * C) / sum(P + r * R + C for r in steps)
    print(f"validation at r = {args.recurrence}, {args.rows} rows of 32 tokens, (P, R, C) = ({P}, {R}, {C})")
    print(f"one pass: {fast * 1e3:.0f} ms; a forward per r: {slow * 1e3:.0f} ms (best of {args.repeats}); same losses")
    print(f"ratio {fast / slow:.2f} measured, {predicted:.2f} predicted by the layer counts")


if __name__ == "__main__":
    main()

"""Does more test-time recurrence answer deeper questions? A retrofit of the embedded SmolLM2-135M and its parent,
trained on the same k-hop dereferencing examples (recurfit.data.depth_task), scored per hop count on held-out
chains at several r (the parent once). Writes a JSON of the recipe, the accuracies and the times.

    PYTHONPATH=$PWD .venv/bin/python scripts/depth_task_study.py --shape 2 4 2 --steps 200 --out runs/depth.json

The loss is the cross-entropy of the answer tokens only (a few per example). recurfit's training loop trains on
every token of a packed store, which here would mostly be the programs' random names, so the study steps the
models itself: AdamW on the answers, the recurrence of each step drawn uniformly from 1..--train-r with the last
--backprop of them taking gradient.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import recurfit
from recurfit.data.depth_task import examples
from recurfit.model.loading import load_model, load_tokenizer


def batch_tensors(batch, tokenizer, device):
    """Right-padded ids and mask, and the (row, position, answer id, hops) of every answer (the position whose
    logits predict it)."""
    ids = [tokenizer(e.text).input_ids for e in batch]
    assert all(len(row) == len(e.text) for row, e in zip(ids, batch)), "one token per character"
    width = max(map(len, ids))
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    answers = [(i, index - 1, ids[i][index], hops) for i, e in enumerate(batch) for index, _, hops in e.answers]
    return input_ids.to(device), mask.to(device), answers


def answer_logits(model, input_ids, mask, answers, **kwargs):
    """The logits at the answer positions only (the head over every position would cost more than the core)."""
    keep = sorted({position for _, position, _, _ in answers})
    column = {position: j for j, position in enumerate(keep)}
    logits = model(input_ids, attention_mask=mask, logits_to_keep=torch.tensor(keep), **kwargs).logits
    rows = torch.tensor([row for row, _, _, _ in answers])
    return logits[rows, torch.tensor([column[p] for _, p, _, _ in answers])]


def train(model, tokenizer, args, recurrent: bool) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    data = examples("train", args.steps * args.batch, range(1, args.train_hops + 1), args.chains, seed=args.seed)
    rng, losses = random.Random(args.seed), []
    for step in range(args.steps):
        batch = [next(data) for _ in range(args.batch)]
        input_ids, mask, answers = batch_tensors(batch, tokenizer, args.device)
        kwargs = {}
        if recurrent:
            r = rng.randint(args.min_train_r, args.train_r)
            kwargs["num_steps"] = (r - min(r, args.backprop), min(r, args.backprop))
        logits = answer_logits(model, input_ids, mask, answers, **kwargs)
        loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor([a[2] for a in answers]).to(args.device))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0:
            print(f"  step {step + 1}/{args.steps}: loss {sum(losses[-args.log_every :]) / args.log_every:.3f}")
    return losses


@torch.no_grad()
def accuracy(model, tokenizer, args, hops: int, **kwargs) -> float:
    """Teacher-forced accuracy of the answers on held-out chains of `hops` hops (argmax over the vocabulary)."""
    model.eval()
    right = total = 0
    test = list(examples("test", args.test_examples, [hops], args.test_chains, seed=args.seed))
    for start in range(0, len(test), args.batch):
        input_ids, mask, answers = batch_tensors(test[start : start + args.batch], tokenizer, args.device)
        predicted = answer_logits(model, input_ids, mask, answers, **kwargs).argmax(-1).tolist()
        right += sum(p == a[2] for p, a in zip(predicted, answers))
        total += len(answers)
    return right / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 4, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--train-hops", type=int, default=4)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--test-chains", type=int, default=3)
    parser.add_argument("--test-hops", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--test-examples", type=int, default=64)
    parser.add_argument("--train-r", type=int, default=8, help="largest recurrence drawn in training")
    parser.add_argument("--min-train-r", type=int, default=1)
    parser.add_argument("--backprop", type=int, default=4, help="recurrences with gradient")
    parser.add_argument("--recurrences", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--no-parent", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON file of the results")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(None)
    result = {"args": vars(args), "accuracy": {}, "seconds": {}}
    models = [("retrofit", tuple(args.shape))] + ([] if args.no_parent else [("parent", None)])
    for name, shape in models:
        start = time.perf_counter()
        parent = load_model(None, dtype=torch.float32)
        model = (recurfit.retrofit(parent, shape) if shape else parent).to(args.device)
        print(f"Training the {name}")
        result.setdefault("loss", {})[name] = train(model, tokenizer, args, recurrent=shape is not None)
        result["seconds"][f"train {name}"] = time.perf_counter() - start
        start = time.perf_counter()
        for r in args.recurrences if shape else [None]:
            key = f"r={r}" if r else "parent"
            kwargs = {"num_steps": r} if r else {}
            result["accuracy"][key] = {h: accuracy(model, tokenizer, args, h, **kwargs) for h in args.test_hops}
            print(f"  {key}: " + "  ".join(f"{h} hops {a:.0%}" for h, a in result["accuracy"][key].items()))
        result["seconds"][f"evaluate {name}"] = time.perf_counter() - start
    print(json.dumps(result["seconds"]))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()

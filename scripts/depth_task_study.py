"""Does more test-time recurrence answer deeper questions? A retrofit of the embedded SmolLM2-135M and its parent,
trained on the same k-hop dereferencing examples (recurfit.data.depth_task), scored per hop count on held-out
chains at several r (the parent once). Writes a JSON of the recipe, the accuracies and the times.

    PYTHONPATH=$PWD .venv/bin/python scripts/depth_task_study.py --shape 2 4 2 --steps 200 --out runs/depth.json

The loss is the cross-entropy of the answer tokens only (a few per example). recurfit's training loop trains on
every token of a packed store, which here would mostly be the programs' random names, so the study steps the
models itself: AdamW on the answers, the recurrence of each step drawn uniformly from 1..--train-r with the last
--backprop of them taking gradient.

Made cheap enough for a CPU: the head is cut to the task's tokens (letters, digits, "=,.": the loss and the argmax
over those rows of the parent's head, at the answer positions only) and the embeddings are frozen, so neither the
49k-row head nor the embedding's gradient is computed (`--head full --train-embeddings` restores them). Training
examples can ask every variable (`--queries all`), and `--depth-supervision` also reads the coda out after every
recurrence that takes gradient, supervising after recurrence i (the last one included) only the answers of at
most `--hops-per-step` times i hops; with `--trace`, every answer there, its target the variable the query points
to after i hops (its value once i reaches its hop count): the trace of a one-hop-per-recurrence lookup.
The JSON records the seconds per step and their split into forward, backward and optimizer.
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
from recurfit.train.depth_task import TaskHead, accuracy, encode, prepare


class FullHead(torch.nn.Module):
    """The whole head, computed and trained, its logits read at the task's tokens (`--head full`)."""

    def __init__(self, lm_head, tokenizer):
        super().__init__()
        self.lm_head, self.weight = lm_head, lm_head.weight
        self.register_buffer("vocab_ids", TaskHead(lm_head, tokenizer).vocab_ids)

    def forward(self, hidden):
        return self.lm_head(hidden)[..., self.vocab_ids]


def hidden_states(model, batch, recurrent, **kwargs):
    """The final normed hidden states (and, for a retrofit with readout_steps, those read out after them)."""
    out = model.model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, **kwargs)
    return out.last_hidden_state, (out.readout_hidden_states or ()) if recurrent else ()


def answer_logits(head, hidden, batch, due=slice(None)):
    """The head at the answer positions only (the head over every position would cost more than the core)."""
    return head(hidden[batch.rows[due], batch.positions[due]]).float()


def train(model, head, tokenizer, args, recurrent: bool) -> dict:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    adapter = [p for name, p in model.named_parameters() if p.requires_grad and "adapter" in name]
    rest = [p for name, p in model.named_parameters() if p.requires_grad and "adapter" not in name]
    groups = [{"params": rest}] + ([{"params": adapter, "lr": args.lr * args.adapter_lr}] if adapter else [])
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    data = examples(
        "train",
        args.steps * args.batch,
        range(1, args.train_hops + 1),
        args.chains,
        seed=args.seed,
        queries=args.queries,
    )
    rng, losses, times = random.Random(args.seed), [], {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    answers_seen = 0
    for step in range(args.steps):
        batch = encode([next(data) for _ in range(args.batch)], tokenizer, args.train_r).to(args.device)
        answers_seen += len(batch.answers)
        kwargs = {}
        t0 = time.perf_counter()
        if recurrent:
            r = rng.randint(args.min_train_r, args.train_r)
            n, k = r - min(r, args.backprop), min(r, args.backprop)
            kwargs["num_steps"] = (n, k)
            if args.depth_supervision:
                kwargs["readout_steps"] = list(range(n + 1, r))
        final, readouts = hidden_states(model, batch, recurrent, **kwargs)
        readings = list(zip(kwargs.get("readout_steps", []), readouts)) + [
            (kwargs["num_steps"][0] + kwargs["num_steps"][1] if recurrent else None, final)
        ]
        terms, count = [], 0
        for i, hidden in readings:  # with depth supervision, answers of at most hops_per_step * i hops after step i
            if args.trace and i is not None:  # every query, its pointer after i hops (the value once there)
                logits = answer_logits(head, hidden, batch)
                terms.append(torch.nn.functional.cross_entropy(logits, batch.pointers[:, i - 1], reduction="sum"))
                count += len(batch.answers)
                continue
            due = torch.ones_like(batch.hops, dtype=torch.bool)
            if args.depth_supervision and i is not None:
                due = batch.hops <= args.hops_per_step * i
            if due.any():
                logits = answer_logits(head, hidden, batch, due)
                terms.append(torch.nn.functional.cross_entropy(logits, batch.answers[due], reduction="sum"))
                count += int(due.sum())
        loss = sum(terms) / count
        t1 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        t3 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key] += seconds
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0:
            spent = sum(times.values()) / (step + 1)
            print(
                f"  step {step + 1}/{args.steps}: loss {sum(losses[-args.log_every :]) / args.log_every:.3f}"
                f"  {spent:.2f} s/step",
                flush=True,
            )
    steps = max(args.steps, 1)
    return {
        "loss": losses,
        "seconds per step": sum(times.values()) / steps,
        "split": {key: value / steps for key, value in times.items()},
        "answers per step": answers_seen / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 4, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--adapter-lr", type=float, default=1.0, help="the adapter's learning rate, times --lr")
    parser.add_argument("--train-hops", type=int, default=4)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--test-chains", type=int, default=3)
    parser.add_argument("--test-hops", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--test-examples", type=int, default=64)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--queries", choices=["one", "all"], default="one", help="training queries per chain")
    parser.add_argument("--head", choices=["task", "full"], default="task")
    parser.add_argument("--train-embeddings", action="store_true")
    parser.add_argument("--depth-supervision", action="store_true")
    parser.add_argument("--hops-per-step", type=int, default=1)
    parser.add_argument(
        "--trace", action="store_true", help="with --depth-supervision: after recurrence i, the pointer after i hops"
    )
    parser.add_argument("--prelude", type=int, nargs="+", help="layer indices (with --core, --coda): by hand")
    parser.add_argument("--core", type=int, nargs="+")
    parser.add_argument("--coda", type=int, nargs="+")
    parser.add_argument("--adapter", choices=["linear", "add"], default="linear")
    parser.add_argument("--state-gain", type=float, default=0.0, help="the linear adapter's W_s starts as gain · I")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-r", type=int, default=8, help="largest recurrence drawn in training")
    parser.add_argument("--min-train-r", type=int, default=1)
    parser.add_argument("--backprop", type=int, default=4, help="recurrences with gradient")
    parser.add_argument("--recurrences", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--no-parent", action="store_true")
    parser.add_argument("--no-retrofit", action="store_true", help="train and score the parent only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON file of the results")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(None)
    result = {"args": vars(args), "accuracy": {}, "seconds": {}, "training": {}}
    models = ([] if args.no_retrofit else [("retrofit", tuple(args.shape))]) + (
        [] if args.no_parent else [("parent", None)]
    )
    for name, shape in models:
        start = time.perf_counter()
        parent = load_model(None, dtype=torch.float32)
        layers = dict(prelude=args.prelude, core=args.core, coda=args.coda) if args.core else {}
        model = (
            recurfit.retrofit(parent, None if layers else shape, adapter=args.adapter, **layers) if shape else parent
        )
        if shape and args.state_gain:  # W_s = gain · I: the state reaches the core from the first step
            with torch.no_grad():
                hidden = model.model.adapter.out_features
                model.model.adapter.weight[:, :hidden] = args.state_gain * torch.eye(hidden)
        model = model.to(args.device)
        if args.head == "task":
            head = prepare(model, tokenizer)  # the 49k-row head leaves the model (and the optimizer)
        else:
            head = FullHead(model.lm_head, tokenizer).to(args.device)
        model.get_input_embeddings().weight.requires_grad_(args.train_embeddings)
        print(f"Training the {name}", flush=True)
        result["training"][name] = train(model, head, tokenizer, args, recurrent=shape is not None)
        result["seconds"][f"train {name}"] = time.perf_counter() - start
        print(f"  {json.dumps({k: v for k, v in result['training'][name].items() if k != 'loss'})}", flush=True)
        start = time.perf_counter()
        for r in args.recurrences if shape else [None]:
            key = f"r={r}" if r else "parent"
            result["accuracy"][key] = {
                h: accuracy(
                    model, head, tokenizer, h, r, args.test_examples, args.test_chains, args.seed, args.eval_batch
                )
                for h in args.test_hops
            }
            print(f"  {key}: " + "  ".join(f"{h} hops {a:.0%}" for h, a in result["accuracy"][key].items()), flush=True)
        result["seconds"][f"evaluate {name}"] = time.perf_counter() - start
    print(json.dumps(result["seconds"]))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()

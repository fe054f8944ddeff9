"""The memory plan against measured peaks: training steps of tiny random Llama retrofits on the CPU.

    .venv/bin/python benchmarks/memory_plan.py              # 3 shapes × k = 2, 4, chunked and plain loss,
                                                            # distillation with depth supervision,
                                                            # gradient checkpointing
    .venv/bin/python benchmarks/memory_plan.py --quick      # one shape, one k (a smoke test)
    .venv/bin/python benchmarks/memory_plan.py --loss       # the loss alone at Llama-3's 128,256-token vocabulary
    .venv/bin/python benchmarks/memory_plan.py --distill    # only the distillation cases
    .venv/bin/python benchmarks/memory_plan.py --fsdp       # FSDP2 over 2 and 4 gloo processes (torchrun),
                                                            # a model whose recurrent body dominates, fp32 and
                                                            # bf16, both fsdp_units
    .venv/bin/python benchmarks/memory_plan.py --fsdp --phases  # and where each peak falls among FSDP2's hooks

Each measurement runs in a fresh process: build the model (retrofit of a random parent) and its optimizers,
read the resident set (VmRSS), reset the kernel's high-water mark (`/proc/self/clear_refs`), run two
optimizer steps of two micro-batches each (forward with (n, k) = (2, k), loss, backward; clip; Muon+AdamW
step; gradients set to None), and read the high-water mark (VmHWM). The measured peak is the high-water mark
less the resident set before the steps, which holds the weights (and the teacher's): it is compared with the
plan's peak less the same weights. glibc is told to serve every allocation of 128 KiB or more by mmap
(MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident set at once and the high-water mark is
that of live memory, not of the heap's fragmentation. torch's CPU allocator caches nothing.

Under FSDP2 (`--fsdp`) each of W processes builds the same model and shards it as the trainer does
(`Processes.wrap`), then measures as above; the table shows the largest of the processes' peaks, against the plan
at W processes less its (sharded) weights.

The plain loss is lm_head's whole logits (and the teacher's) and the loss on them (a float32 copy of all the
logits, a float32 log-softmax kept for backward, the teacher's log-probabilities once per supervised depth);
the chunked one is the trainer's (train/head.py): the saving is the difference. `--loss` measures the loss
alone (forward and backward from final hidden states already computed, under bf16 autocast as on a GPU, or
fp32) at a large vocabulary, where the difference matters most; its prediction is the plan's "logits and
loss" (and, under autocast, the head's bf16 copy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from recurfit.defaults import FSDP_UNITS

SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, (P, R, C), micro-batch, seq_len
    "A": dict(hidden=512, intermediate=1376, heads=8, kv_heads=2, vocab=32000, shape=[2, 2, 2], micro=4, seq=256),
    "B": dict(hidden=768, intermediate=2048, heads=12, kv_heads=4, vocab=8192, shape=[1, 2, 1], micro=2, seq=512),
    "C": dict(hidden=384, intermediate=1024, heads=6, kv_heads=6, vocab=50304, shape=[1, 3, 1], micro=8, seq=128),
    # FSDP2's: 5 of its 6 layers' weights (core and coda) in the recurrent body, few activations
    "D": dict(hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=8192, shape=[1, 4, 1], micro=1, seq=128),
}
FSDP_WORLDS = (2, 4)


def cases(quick: bool, distill_only: bool = False, fsdp: bool = False) -> list[dict]:
    if fsdp:
        return [
            dict(shape="D", k=2, loss="chunked", world=world, units=units, precision=precision)
            for precision in ("fp32", "bf16")
            for units in FSDP_UNITS
            for world in FSDP_WORLDS
        ]
    if quick:
        return [dict(shape="A", k=2, loss="chunked")]
    distilled = [dict(shape="A", k=4, loss=loss, distill=True) for loss in ("chunked", "plain")]
    if distill_only:
        return distilled
    runs = [dict(shape=s, k=k, loss=loss) for s in SHAPES for k in (2, 4) for loss in ("chunked", "plain")]
    return runs + distilled + [dict(shape="B", k=4, loss="chunked", checkpointing=True)]


# ---------------------------------------------------------------- one measurement (a child process)


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as file:
        line = next(line for line in file if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def clear_peak() -> None:
    """Reset VmHWM to the current resident set."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")


class Phases:
    """Where the peak falls: the high-water mark of each interval between FSDP2's hooks (each unit's pre- and
    post-forward, pre- and post-backward, and its collectives: foreach_all_gather, foreach_all_gather_copy_out,
    foreach_reduce, each entered and left), labelled by the hook that ends it, above the resident set `before`."""

    HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward")
    COLLECTIVES = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")

    def __init__(self, before: int):
        self.before, self.marks = before, []

    def mark(self, label: str) -> None:
        self.marks.append((label, status("VmHWM") - self.before, status("VmRSS") - self.before))
        clear_peak()

    def watch(self):
        """Patch FSDP2's hooks and collectives to mark their entries and exits; returns the undo."""
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

        originals = []

        def patched(owner, name, fqn):
            original = getattr(owner, name)

            def call(*args, **kwargs):
                where = f"{name} {fqn(args)}"
                self.mark(f"> {where}")
                try:
                    return original(*args, **kwargs)
                finally:
                    self.mark(f"< {where}")

            originals.append((owner, name, original))
            setattr(owner, name, call)

        for name in self.HOOKS:
            patched(group_module.FSDPParamGroup, name, lambda args: args[0]._module_fqn or "root")
        for name in self.COLLECTIVES:
            patched(group_module, name, lambda args: "")
        return lambda: [setattr(owner, name, original) for owner, name, original in originals]

    def peak(self) -> tuple[str, int]:
        label, peak, _ = max(self.marks, key=lambda mark: mark[1])
        return label, peak


def build(case: dict):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recurfit import retrofit
    from recurfit.model.compat import enable_activation_checkpointing
    from recurfit.train import load_config
    from recurfit.train.parts import select_parts

    size = SHAPES[case["shape"]]
    parent_config = LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=sum(size["shape"]) + 2,
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    parent = AutoModelForCausalLM.from_config(parent_config, dtype=torch.float32)
    model = retrofit(parent, tuple(size["shape"]), adapter_init="torch-default").train()
    overrides = [
        "out=unused",
        "data.phases=[{sources: [unused]}]",
        f"batch.micro={size['micro']}",
        f"batch.global={2 * size['micro']}",
        f"depth.mean_recurrence={case['k'] + 2}",
        f"depth.backprop_depth={case['k']}",
        f"precision={case.get('precision', 'fp32')}",
        f"distributed={'fsdp' if case.get('world', 1) > 1 else 'ddp'}",
        f"fsdp_units={case.get('units', 'recurrence')}",
    ]
    if case.get("distill"):
        overrides += ["distill={alpha: 0.5, temperature: 2.0}", "depth.supervise={last: 2}"]
    if case.get("checkpointing"):
        overrides.append("model.gradient_checkpointing=true")
        enable_activation_checkpointing(model)  # as build_model
    config = load_config(None, overrides)
    # The teacher: a parent of its own (the retrofit adopted the first one's tensors), frozen.
    teacher = AutoModelForCausalLM.from_config(parent_config, dtype=torch.float32) if case.get("distill") else None
    if teacher is not None:
        teacher.requires_grad_(False).eval()
    return config, select_parts(model, config), teacher


def plain_loss(healing, logits: list, targets, teacher_logits):
    """The objective as computed before the chunked losses: whole-vocabulary float32 log-softmaxes."""
    import torch.nn.functional as F

    from recurfit.train.losses import depth_weights

    def ce(z):
        return F.cross_entropy(z.float().flatten(0, 1), targets.flatten())

    def kl(z, temperature):
        student = F.log_softmax(z.float().flatten(0, 1) / temperature, dim=-1)
        teacher = F.log_softmax(teacher_logits.float().flatten(0, 1) / temperature, dim=-1)
        return F.kl_div(student, teacher, reduction="batchmean", log_target=True)

    weights = depth_weights(len(logits), "uniform")
    if healing.distill is None:
        return sum(w * ce(z) for w, z in zip(weights, logits))
    alpha, temperature = healing.distill.alpha, healing.distill.temperature
    return sum(w * (alpha * ce(z) + (1 - alpha) * temperature**2 * kl(z, temperature)) for w, z in zip(weights, logits))


def measure(case: dict) -> dict:
    import torch

    from recurfit.train.head import final_hidden_states
    from recurfit.train.losses import HealingLoss
    from recurfit.train.memory import plan_memory
    from recurfit.train.optim import build_optimizers, global_grad_norm

    torch.set_num_threads(2)
    config, model, teacher = build(case)
    world = case.get("world", 1)
    bf16 = config.precision == "bf16"  # autocast, and FSDP2 gathering in bf16, as on a GPU
    processes = sharded(model, bf16, config.fsdp_units == "layer") if world > 1 else None
    size = SHAPES[case["shape"]]
    healing = HealingLoss(config.distill, config.depth.supervise)
    optimizers = build_optimizers(model, config.optimizer)
    num_steps = (2, case["k"])
    readouts = healing.readout_steps(num_steps)
    rows = torch.randint(0, size["vocab"], (2, size["micro"], size["seq"] + 1), generator=torch.Generator())
    teacher_parameters = sum(p.numel() for p in teacher.parameters()) if teacher is not None else 0
    plan = plan_memory(config, model, size["seq"], world=world, device="cpu", teacher_parameters=teacher_parameters)
    before = status("VmRSS")
    clear_peak()
    phases = Phases(before)
    unwatch = phases.watch() if case.get("phases") else lambda: None
    for _ in range(2):
        for micro_batch in rows:
            inputs, targets = micro_batch[:, :-1], micro_batch[:, 1:]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the trainer's autocast
                if case["loss"] == "chunked":  # the trainer's: from the hidden states, a chunk at a time
                    hidden, weight = final_hidden_states(
                        model, model, inputs, num_steps=num_steps, readout_steps=readouts
                    )
                    teacher_states = None
                    if teacher:
                        with torch.no_grad():
                            teacher_hidden, teacher_weight = final_hidden_states(teacher, teacher, inputs)
                        teacher_states = (teacher_hidden[-1], teacher_weight)
                    loss = healing(hidden, weight, targets.flatten(), teacher_states, {})
                    del hidden, teacher_states
                else:
                    output = model(input_ids=inputs, num_steps=num_steps, readout_steps=readouts)
                    logits = [*(output.readout_logits or ()), output.logits]
                    with torch.no_grad():
                        teacher_logits = teacher(input_ids=inputs).logits if teacher is not None else None
                    loss = plain_loss(healing, logits, targets, teacher_logits)
                    del output, logits, teacher_logits
            phases.mark("loss")
            (loss / len(rows)).backward()
            del loss
            phases.mark("backward")
        global_grad_norm(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phases.mark("optimizer step")
    unwatch()
    measured = max(peak for _, peak, _ in phases.marks)
    where = phases.peak()[0]
    if processes is not None:  # the largest process's
        import torch.distributed as dist

        every = [None] * world
        dist.all_gather_object(every, (measured, where, phases.marks if case.get("phases") else []))
        measured, where, marks = max(every, key=lambda one: one[0])
        phases.marks = marks
        del model, optimizers
        processes.close()
    weights = plan.parameters + plan.teacher  # resident before the steps, as measured
    result = {**case, "measured": measured, "predicted": plan.peak - weights, "parts": plan.parts(), "at": where}
    return result | ({"marks": phases.marks} if case.get("phases") else {})


def sharded(model, bf16: bool, layers: bool):
    """This torchrun process's group, `model` sharded in it as the trainer shards it."""
    from recurfit.train.distributed import Processes

    processes = Processes.from_environment(timeout=600)
    processes.wrap(model, "fsdp", bf16=bf16, layers=layers)
    return processes


LOSS_VOCAB, LOSS_TOKENS, LOSS_HIDDEN = 128256, 512, 2048  # Llama-3's vocabulary; 512 positions of Llama-3.2-1B's


def loss_cases() -> list[dict]:
    return [
        dict(dtype=dtype, loss=loss, distill=distill)
        for distill in (False, True)
        for dtype in ("bfloat16", "float32")
        for loss in ("chunked", "plain")
    ]


def measure_loss(case: dict) -> dict:
    """The loss's own peak from final hidden states made before (of two supervised depths with distillation):
    the head's loss chunk by chunk, or the head's whole logits and the plain loss on them."""
    import torch
    import torch.nn.functional as F

    from recurfit.train.config import DistillConfig, SuperviseConfig
    from recurfit.train.losses import HealingLoss
    from recurfit.train.memory import loss_bytes

    torch.set_num_threads(2)
    dtype, distill = getattr(torch, case["dtype"]), case["distill"]
    generator = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(LOSS_VOCAB, LOSS_HIDDEN, generator=generator)).requires_grad_()
    teacher_weight = 0.02 * torch.randn(LOSS_VOCAB, LOSS_HIDDEN, generator=generator) if distill else None
    depths = [torch.randn(LOSS_TOKENS, LOSS_HIDDEN, generator=generator) for _ in range(2 if distill else 1)]
    teacher = torch.randn(LOSS_TOKENS, LOSS_HIDDEN, generator=generator) if distill else None
    targets = torch.randint(0, LOSS_VOCAB, (LOSS_TOKENS,), generator=generator)
    healing = HealingLoss(DistillConfig() if distill else None, SuperviseConfig() if distill else None)
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if case["loss"] == "chunked":
            loss = healing(depths, weight, targets, (teacher, teacher_weight) if distill else None, {})
        else:
            logits = [F.linear(depth, weight)[None] for depth in depths]
            teacher_logits = F.linear(teacher, teacher_weight)[None] if distill else None
            loss = plain_loss(healing, logits, targets[None], teacher_logits)
            del logits, teacher_logits
    loss.backward()
    measured = status("VmHWM") - before
    planned = loss_bytes(
        LOSS_TOKENS,
        LOSS_VOCAB,
        LOSS_HIDDEN,
        dtype == torch.bfloat16,
        distill=distill,
        head_trained=True,
        teacher_itemsize=4,
    )
    if dtype == torch.bfloat16:  # the head's bf16 copy, which the plan counts among the autocast copies
        planned += 2 * LOSS_VOCAB * LOSS_HIDDEN
    return {**case, "measured": measured, "predicted": planned}


# ---------------------------------------------------------------- the table


def run_child(case: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="2")
    world = case.get("world", 1)
    launch = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}"] if world > 1 else [sys.executable]
    )
    done = subprocess.run(
        [*launch, __file__, "--one", json.dumps(case)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def label(result: dict) -> str:
    size = SHAPES[result["shape"]]
    what = f"{result['shape']}: h {size['hidden']}, V {size['vocab']:,}, {tuple(size['shape'])}"
    what += f", {size['micro']}×{size['seq']}, k={result['k']}"
    what += ", distill+supervise 2" if result.get("distill") else ""
    what += f", FSDP2 × {result['world']}" if result.get("world", 1) > 1 else ""
    what += " by layer" if result.get("units") == "layer" else ""
    what += ", bf16" if result.get("precision") == "bf16" else ""
    return what + (", checkpointing" if result.get("checkpointing") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--loss", action="store_true", help="the loss alone, plain against chunked")
    parser.add_argument("--distill", action="store_true", help="only the distillation cases")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over 2 and 4 gloo processes")
    parser.add_argument("--phases", action="store_true", help="also record where each peak falls (FSDP2's hooks)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.one:
        case = json.loads(args.one)
        result = measure_loss(case) if "dtype" in case else measure(case)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(result))
        return
    if args.loss:
        return loss_table(args.json)
    results = []
    print(f"{'case':58s} {'loss':8s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}")
    for case in cases(args.quick, args.distill, args.fsdp):
        result = run_child(case | ({"phases": True} if args.phases else {}))
        results.append(result)
        predicted, measured = result["predicted"], result["measured"]
        ratio = f"{predicted / measured:6.3f}" if result["loss"] == "chunked" else "     —"
        print(f"{label(result):58s} {result['loss']:8s} {predicted / 2**20:8.0f} Mi {measured / 2**20:7.0f} Mi {ratio}")
        if args.phases:
            print(f"    peak at: {result['at']}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


def loss_table(path: str | None) -> None:
    results = []
    print(f"the loss alone: V {LOSS_VOCAB:,}, {LOSS_TOKENS} positions")
    print(f"{'case':40s} {'loss':8s} {'predicted':>10s} {'measured':>10s} {'ratio':>6s}")
    for case in loss_cases():
        result = run_child(case)
        results.append(result)
        what = f"{case['dtype']} logits" + (", distill + 2 supervised depths" if case["distill"] else ", CE")
        predicted, measured = result["predicted"], result["measured"]
        chunked = case["loss"] == "chunked"
        shown = f"{predicted / 2**20:8.0f} Mi" if chunked else "         —"
        ratio = f"{predicted / measured:6.3f}" if chunked else "     —"
        print(f"{what:40s} {case['loss']:8s} {shown} {measured / 2**20:7.0f} Mi {ratio}")
    if path:
        with open(path, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()

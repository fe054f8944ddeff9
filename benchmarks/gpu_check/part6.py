"""Part 6: self-speculative decoding at r = 32 on a retrofit worth drafting from. A TinyLlama-shaped (4, 8, 4)
retrofit of a random parent is first trained on the device for a few hundred steps on recurfit's generated word
problems at r̄ = 8 (benchmarks/train_setup.prepare_drafting), so that its depths agree where the text is predictable
and differ on the arithmetic; then benchmarks/decode.py's self-speculative section decodes word problems at r = 32
(4× the trained depth), batch 1 and 32, in bf16: plain greedy against fixed and adaptive drafts at r = 2, their
acceptance and whether the tokens are identical. The anchor: LoopSpec (SGLang, tree drafts, CUDA graphs) reports
5.88-6.83× at R = 32 on the paper's retrofits at batch 1. Then adaptive exit on the same retrofit, compiled:
tokens/s with the `kl` rule at cap r = 32 against compiled fixed r = 32, batch 32, with the CUDA graphs replayed.
(Part 3, the decoding part of the random retrofit, has no time left; here the retrofit is one whose depths settle.)"""

from __future__ import annotations

from train_setup import prepare_drafting

from .common import BENCH, DEVICE, PART_BUDGET, BenchSizes, Part, Step, python
from .context import Context
from .decoding import graph_use, graphs_text

# decode.py's self-speculative section on the trained retrofit: its word problems, only r = 1 in the speed table.
FULL_SPECULATION = "--spec-depths 32 --draft-steps 2 --lookahead 4 --prompt 64 --decode 64 --repeats 2 --depths 1"
SMOKE_SPECULATION = "--spec-depths 4 --draft-steps 1 --lookahead 4 --prompt 8 --decode 6 --repeats 1 --depths 1"


def speculate(b: BenchSizes, sequences: int) -> list:
    """decode.py's section 4 on the retrofit the part trained, against its parent, on word problems."""
    run = b.work / "drafting-run" / "final"
    options = (SMOKE_SPECULATION if b.smoke else FULL_SPECULATION).split()
    return python(
        BENCH / "decode.py",
        run,
        "--parent",
        b.work / "drafting-parent",
        "--text",
        "word-problems",
        "--sections",
        4,
        "--sequences",
        sequences,
        "--device",
        b.device,
        "--dtype",
        b.dtype,
        *options,
    )


PART = Part(
    "self-speculative decoding at r = 32 on a retrofit trained on the device",
    (
        DEVICE,
        Step("prepare-drafting", 40, "train_setup.py: word problems, a word-level tokenizer, a parent, drafting.yaml"),
        Step(
            "train-drafting",
            200,
            "recurfit train: the (4, 8, 4) retrofit on word problems, 300 steps at r̄ = 8",
            lambda b: python("-m", "recurfit", "train", b.work / "drafting.yaml"),
        ),
        Step(
            "speculative-r32-batch-1",
            60,
            "decode.py: self-speculative decoding at r = 32 from r = 2 drafts, batch 1 (LoopSpec: 5.88-6.83×)",
            lambda b: speculate(b, 2 if b.smoke else 1),
        ),
        Step(
            "speculative-r32-batch-32",
            90,
            "the same at batch 32",
            lambda b: speculate(b, 2 if b.smoke else 32),
        ),
        Step("exit-r32-batch-32", 150, "compiled adaptive exit (kl:5e-4) against compiled fixed r = 32, batch 32"),
    ),
    PART_BUDGET,
    6,
)


def step_prepare_drafting(ctx: Context) -> None:
    prepare_drafting(ctx.work, ctx.smoke)
    ctx.record("prepare-drafting", f"word problems, a tokenizer, a parent and drafting.yaml in {ctx.work}")


# The exit step: the healing study's rule, the host's look every 4 steps; cap, batch, prompt and new tokens.
EXIT_RULE, EXIT_CHECK_EVERY = "kl:5e-4", 4
FULL_EXIT = dict(cap=32, batch=32, prompt=64, new=64, repeats=2)
SMOKE_EXIT = dict(cap=4, batch=2, prompt=8, new=6, repeats=1)


def step_exit(ctx: Context) -> None:
    """Greedy decoding of word problems with the retrofit the part trained, compiled (CUDA graphs on the GPU): at
    fixed r = cap, and under the exit rule capped at r; each timed after a warm-up call (compile and capture), the
    median of `repeats`. Then the exit run's tokens and per-token depths against uncompiled `generate` with the
    same rule (equal in fp32; in bf16 the share that agrees), and the graphs: tokens replayed, runs of
    `check_every` steps replayed past a token's first (the host's waits), tokens run without a graph."""
    import statistics
    import time

    import torch
    from decode import passages

    from recurfit.generation import ExitRule
    from recurfit.model.loading import load_model, load_tokenizer

    torch.set_grad_enabled(False)
    sizes = SMOKE_EXIT if ctx.smoke else FULL_EXIT
    folder = ctx.work / "drafting-run" / "final"
    dtype = torch.bfloat16 if ctx.sizes.dtype == "bf16" else torch.float32
    model, tokenizer = load_model(folder, dtype=dtype, device=ctx.device).eval(), load_tokenizer(folder)
    rows = passages(tokenizer, sizes["batch"], sizes["prompt"], text="word-problems").to(ctx.device)
    rule = ExitRule.parse(EXIT_RULE, check_every=EXIT_CHECK_EVERY)

    def greedy(exit_rule, compile, **kwargs):
        return model.generate(
            rows, attention_mask=torch.ones_like(rows), max_new_tokens=sizes["new"],
            do_sample=False, num_steps=sizes["cap"], pad_token_id=0, exit_rule=exit_rule, compile=compile, **kwargs,
        )  # fmt: skip

    def tokens_per_s(exit_rule) -> tuple[float, dict]:
        greedy(exit_rule, ctx.sizes.compile)  # compiles (the first time) and captures
        before, seconds, made = graph_use(model), [], 0
        for _ in range(sizes["repeats"]):
            ctx.synchronize()
            start = time.perf_counter()
            made = greedy(exit_rule, ctx.sizes.compile).shape[1] - rows.shape[1]
            ctx.synchronize()
            seconds.append(time.perf_counter() - start)
        return sizes["batch"] * made / statistics.median(seconds), graph_use(model, before)

    fixed, fixed_use = tokens_per_s(None)
    adaptive, use = tokens_per_s(rule)
    compiled = greedy(rule, ctx.sizes.compile, return_dict_in_generate=True)
    eager = greedy(rule, False, return_dict_in_generate=True)
    depths = compiled.steps_per_token[:, 1:].float()  # the prompt's forward runs every step
    same_tokens = share_equal(compiled.sequences, eager.sequences)
    same_depths = share_equal(compiled.steps_per_token, eager.steps_per_token)
    runs = use["exit runs"] / max(use["replayed"], 1)
    ctx.record(
        "exit-r32-batch-32",
        f"adaptive exit {EXIT_RULE} (checked every {EXIT_CHECK_EVERY} steps) at cap r = {sizes['cap']}, batch "
        f"{sizes['batch']}, compiled: {adaptive:.0f} tokens/s against {fixed:.0f} at fixed r = {sizes['cap']} "
        f"({adaptive / fixed:.2f}×); mean exit depth {depths.mean():.1f}; tokens equal to uncompiled exit's: "
        f"{same_tokens:.1%}, depths: {same_depths:.1%}; {runs:.1f} runs of {EXIT_CHECK_EVERY} steps past the first "
        f"per replayed token; fixed depth: {graphs_text(fixed_use)}; exit: {graphs_text(use)}",
        # fp32 must be exact; bf16's near-ties may differ (reported)
        ok=not use["failures"]
        and not fixed_use["failures"]
        and (dtype != torch.float32 or same_tokens == same_depths == 1),
        cap=sizes["cap"],
        batch=sizes["batch"],
        fixed_tokens_s=fixed,
        exit_tokens_s=adaptive,
        mean_exit_depth=depths.mean().item(),
        same_tokens=same_tokens,
        same_depths=same_depths,
        graph_use=use,
        fixed_graph_use=fixed_use,
    )


def share_equal(ours, theirs) -> float:
    """The share of (row, token) entries two generations agree on, over the tokens both made (in bf16 an EOS may
    come at another token)."""
    made = min(ours.shape[1], theirs.shape[1])
    return (ours[:, :made] == theirs[:, :made]).float().mean().item()


STEP_FUNCTIONS = {"prepare-drafting": step_prepare_drafting, "exit-r32-batch-32": step_exit}

"""Part 6: self-speculative decoding at r = 32 on a retrofit worth drafting from. A TinyLlama-shaped (4, 8, 4)
retrofit of a random parent is first trained on the device for a few hundred steps on recurfit's generated word
problems at r̄ = 8 (benchmarks/train_setup.prepare_drafting), so that its depths agree where the text is predictable
and differ on the arithmetic; then benchmarks/decode.py's self-speculative section decodes word problems at r = 32
(4× the trained depth), batch 1 and 32, in bf16: plain greedy against fixed and adaptive drafts at r = 2, their
acceptance and whether the tokens are identical. The anchor: LoopSpec (SGLang, tree drafts, CUDA graphs) reports
5.88-6.83× at R = 32 on the paper's retrofits at batch 1."""

from __future__ import annotations

from train_setup import prepare_drafting

from .common import BENCH, DEVICE, PART_BUDGET, BenchSizes, Part, Step, python
from .context import Context

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
    ),
    PART_BUDGET,
    6,
)


def step_prepare_drafting(ctx: Context) -> None:
    prepare_drafting(ctx.work, ctx.smoke)
    ctx.record("prepare-drafting", f"word problems, a tokenizer, a parent and drafting.yaml in {ctx.work}")


STEP_FUNCTIONS = {"prepare-drafting": step_prepare_drafting}

"""How far each attention implementation's bf16 logits are from the float32 eager reference, on the tests' tiny
retrofits (random adapter, s_0 = 0, r = 3), with one row left-padded by `--padding` tokens.

    python benchmarks/attention_bf16.py --device cuda [--padding 4] [--families olmo2,mistral,llama,qwen3]

Prints, per family and implementation, the largest |Δlogit| over real positions against float32 eager, and against
bf16 eager. Use: the bound of tests/test_surgery_parity.py's attention test, and where a backend parts from the
others on a device.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import conftest  # noqa: E402  (the tests' tiny models and tokens)

import recurfit  # noqa: E402

IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")


def logits_per_implementation(family: str, padding: int) -> tuple[dict, torch.Tensor]:
    model = recurfit.retrofit(conftest.tiny_parent(family), shape=(2, 2, 2), adapter_init="random", state_init_std=0.0)
    ids = conftest.token_batch()
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0
    logits = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            for implementation in IMPLEMENTATIONS:
                model.set_attn_implementation(implementation)
                logits[dtype, implementation] = model(ids, attention_mask=mask, num_steps=3).logits.float()
    return logits, mask.bool()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--padding", type=int, default=4)
    parser.add_argument("--families", default="olmo2,mistral,llama,qwen3")
    args = parser.parse_args()
    conftest.PLACEMENT.device = torch.device(args.device)
    print(f"{args.device}, torch {torch.__version__}; |Δlogit| on real positions, a row left-padded by {args.padding}")
    columns = ("fp32 vs fp32 eager", "bf16 vs fp32 eager", "bf16 vs bf16 eager")
    print(f"{'family':10} {'implementation':16} " + " ".join(f"{column:>20}" for column in columns))
    for family in args.families.split(","):
        logits, real = logits_per_implementation(family, args.padding)
        reference = logits[torch.float32, "eager"]
        for implementation in IMPLEMENTATIONS:
            fp32, bf16 = logits[torch.float32, implementation], logits[torch.bfloat16, implementation]
            errors = (fp32 - reference, bf16 - reference, bf16 - logits[torch.bfloat16, "eager"])
            print(f"{family:10} {implementation:16} " + " ".join(f"{e[real].abs().max().item():20.4f}" for e in errors))


if __name__ == "__main__":
    main()

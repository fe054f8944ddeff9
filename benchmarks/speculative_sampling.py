"""Does vLLM's speculative decoding keep the target's distribution when it samples? A measurement, on the CPU build.

    .venv-vllm/bin/python benchmarks/speculative_sampling.py [--requests 4000]

Two tiny random models (a Llama target and a Llama draft of another seed; and a recurfit retrofit of the target,
drafting for itself at depth 1 through `recurfit draft`'s folder) are served with vLLM's `draft_model` speculation,
and `--requests` requests of one prompt each sample two tokens at temperature 1. The second token's distribution
is the one speculation decides (the first comes from the prompt's forward alone): its empirical distribution is
compared, by total variation, with the exact one of the target (Σ_x p(x | prompt) p(y | prompt, x), computed
with transformers) and with the one the draft would give in its place. Without speculation the same engine lands
within sampling noise of the target (the control); a lossless sampler does too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import recurfit  # noqa: E402
from recurfit.serving.draft import write_draft  # noqa: E402

VOCAB = 97
PROMPT = [2, 40, 11, 73, 5, 60, 23, 88, 31]


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """A 6-layer Llama of hidden size 64 (2 heads of 32, vLLM's CPU minimum), weights spread so it samples widely."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * (0.2 if parameter.dim() == 2 else 0.05))
    return model


@torch.no_grad()
def second_token(first, second) -> torch.Tensor:
    """The distribution of the second sampled token when `first` gives the first token and `second` the next."""
    p1 = first(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    p2 = second(torch.tensor([PROMPT + [x] for x in range(VOCAB)])).logits[:, -1].softmax(-1)
    return p1 @ p2


def sampled(folder: Path, requests: int, speculative: dict | None) -> torch.Tensor:
    """The empirical distribution of the second of two tokens sampled at temperature 1, `requests` times."""
    import vllm

    llm = vllm.LLM(str(folder), dtype="float32", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True,
                   kv_cache_memory_bytes=64 << 20, seed=0, speculative_config=speculative)  # fmt: skip
    params = vllm.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * requests, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    del llm
    tokens = torch.tensor([o.outputs[0].token_ids[1] for o in outputs])
    return torch.bincount(tokens, minlength=VOCAB).double() / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()  # noqa: E731
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        target, other = tiny_llama(0), tiny_llama(1)
        llama_exact, llama_drafts = second_token(target, target), second_token(target, other)
        retrofit = recurfit.retrofit(
            target, (2, 2, 2), adapter_init="random", state_init_std=0.0, mean_recurrence=4
        ).eval()
        for name, model in (("llama", target), ("llama-draft", other), ("retrofit", retrofit)):
            model.save_pretrained(root / name)
        write_draft(root / "retrofit", 1, root / "retrofit-draft")
        with torch.no_grad():
            pairs = {
                "vLLM's Llama, another Llama drafting": (
                    root / "llama",
                    root / "llama-draft",
                    llama_exact,
                    llama_drafts,
                ),
                "recurfit retrofit r=4, itself at r=1 drafting": (
                    root / "retrofit",
                    root / "retrofit-draft",
                    second_token(retrofit, retrofit),
                    second_token(retrofit, lambda ids: retrofit(ids, num_steps=1)),
                ),
            }
        for name, (folder, draft, exact, drafts) in pairs.items():
            noise = 0.5 * (exact * (1 - exact) / args.requests).sqrt().sum().item()
            print(f"{name}: {args.requests} requests; TV(target, draft's) {tv(exact, drafts):.3f}, "
                  f"expected sampling noise {noise:.3f}")  # fmt: skip
            for label, speculative in (
                ("without speculation", None),
                ("with speculation", {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}),
            ):
                empirical = sampled(folder, args.requests, speculative)
                print(f"  {label}: TV to the target's {tv(empirical, exact):.3f}, "
                      f"to the draft's {tv(empirical, drafts):.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""Text generation for people: prompts through the chat template, streaming, depth and exit settings.

The model side (the step-aware cache, adaptive exit) lives in `cache.py`, `exit.py` and `modeling.py`; this
module turns command-line settings into a `generate` call and reports what it cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import TextStreamer

from .cache import RecurrentCache
from .errors import RecurfitError
from .exit import CRITERIA
from .modeling import RecurrentForCausalLM


@dataclass
class GenerationSettings:
    steps: int | None = None  # recurrences; None: the model's mean recurrence
    exit: str | None = None  # "kl:5e-4", "state:0.01", "argmax:2"
    min_steps: int = 2
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    cache_policy: str = "all"


@dataclass
class Generation:
    text: str
    tokens: int
    seconds: float
    steps_per_token: list[int] | None  # recurrences per generated token (recurrent models)


def parse_exit(spec: str | None) -> dict:
    """'kl:5e-4' → generate kwargs; a clear error for anything else."""
    if spec is None:
        return {}
    criterion, _, value = spec.partition(":")
    if criterion not in CRITERIA:
        raise RecurfitError(f"--exit takes CRITERION[:VALUE] with CRITERION one of {', '.join(CRITERIA)}, got {spec!r}.")
    try:
        number = float(value) if value else None
    except ValueError:
        raise RecurfitError(f"--exit {spec!r}: {value!r} is not a number.") from None
    return {"exit_criterion": criterion, "exit_threshold": number}


def prompt_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Token ids of a conversation: the tokenizer's chat template when it has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt").input_ids


def generate_text(model, tokenizer, ids: torch.Tensor, settings: GenerationSettings, stream: bool = False) -> Generation:
    recurrent = isinstance(model, RecurrentForCausalLM)
    kwargs: dict = dict(
        max_new_tokens=settings.max_new_tokens,
        do_sample=settings.temperature > 0,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        attention_mask=torch.ones_like(ids),
        return_dict_in_generate=True,
    )
    if settings.temperature > 0:
        kwargs.update(temperature=settings.temperature, top_p=settings.top_p)
    if recurrent:
        kwargs.update(num_steps=settings.steps or model.config.mean_recurrence, min_steps=settings.min_steps)
        kwargs.update(parse_exit(settings.exit))
        kwargs["past_key_values"] = RecurrentCache(model.config, policy=settings.cache_policy)
    elif settings.exit:
        raise RecurfitError("--exit needs a recurrent model; this one has a fixed depth.")
    if stream:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(ids.to(model.device), **kwargs)
    seconds = time.perf_counter() - start
    new = output.sequences[0, ids.shape[1] :]
    steps = output.get("steps_per_token")
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True).strip(),
        tokens=len(new),
        seconds=seconds,
        steps_per_token=steps[0, : len(new)].tolist() if steps is not None else None,
    )

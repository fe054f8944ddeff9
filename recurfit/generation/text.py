"""Text generation for people: completion and chat prompts, streaming, depth and exit settings.

The model side (the step-aware cache, the recurrence that drops settled rows, warm starts) lives in
`recurfit.model.cache` and `recurfit.model.modeling`; this module turns settings into a `generate` call and reports what
it cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import TextStreamer

from ..errors import RecurfitError
from ..model.cache import RecurrentCache
from ..model.compat import CACHE_ARG
from ..model.compiled import decoding_cache
from ..model.modeling import RecurrentForCausalLM
from .exit import ExitRule
from .speculative import speculative_generate

# Test-time recurrences a user may ask for. The paper evaluates up to r = 64 (Huginn up to 128); beyond a few
# hundred, each token costs hundreds of core passes and a typo (-r 100000) would look like a hang.
MAX_RECURRENCE = 1024


@dataclass
class GenerationSettings:
    recurrence: int | None = None  # r per token; None: the model's mean recurrence (the model fills it in)
    exit: str | None = None  # "kl:5e-4", "state:0.01", "argmax:2"
    min_steps: int = 2
    exit_check_every: int = 1  # steps between the host's checks whether every row has settled (see ExitRule)
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    cache_policy: str = "all"
    warm_start: bool = False  # start each token's recurrence from the previous token's final state
    draft_steps: int | None = None  # self-speculative decoding: draft at this recurrence, verify at `recurrence`
    lookahead: int = 4  # tokens drafted per verification
    compile: bool = False  # decode through a static cache and a compiled step (recurfit.model.compiled)

    def __post_init__(self):
        if self.recurrence is not None and not 1 <= self.recurrence <= MAX_RECURRENCE:
            raise RecurfitError(
                f"--recurrence must be between 1 and {MAX_RECURRENCE}, got {self.recurrence}; "
                "leave it out for the model's mean recurrence."
            )
        self.exit_rule = ExitRule.parse(self.exit, min_steps=self.min_steps, check_every=self.exit_check_every)
        if self.compile and self.draft_steps is not None:
            raise RecurfitError("--compile does not draft: drop --draft-steps or --compile.")
        if self.draft_steps is not None and (self.exit or self.warm_start or self.temperature > 0):
            raise RecurfitError(
                "--draft-steps (speculative decoding) is greedy at a fixed depth: drop --exit, "
                "--warm-start and --temperature."
            )


@dataclass
class Generation:
    text: str
    tokens: int
    seconds: float
    steps_per_token: list[int] | None  # recurrences per generated token (recurrent models)
    acceptance_rate: float | None = None  # speculative decoding: the share of drafted tokens kept


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """Token ids of a completion prompt: the raw text with the special tokens the tokenizer adds itself (a BOS
    where it has one), as vLLM's /v1/completions encodes a prompt (`add_special_tokens` on, its default)."""
    if not prompt.strip():
        raise RecurfitError('The prompt is empty: pass the text to continue, e.g. --prompt "Once upon a time".')
    return tokenizer(prompt, return_tensors="pt").input_ids


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Token ids of a conversation through the tokenizer's chat template, as vLLM's /v1/chat/completions renders
    it (the template writes the special tokens, so the encoding adds none); a tokenizer without a template gets
    the messages' text, one a line, as a completion prompt."""
    if not any(m["content"].strip() for m in messages):
        raise RecurfitError('The prompt is empty: pass a message, e.g. --prompt "What is 2 + 2?".')
    if not has_chat_template(tokenizer):
        return prompt_ids(tokenizer, "\n".join(m["content"] for m in messages))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def generate_text(
    model, tokenizer, ids: torch.Tensor, settings: GenerationSettings, stream: bool = False
) -> Generation:
    recurrent = isinstance(model, RecurrentForCausalLM)
    if ids.shape[1] == 0:
        raise RecurfitError("The prompt is empty: pass the text to continue.")
    ids = ids.to(model.device)  # a tokenizer's ids are on the CPU; everything built from them must follow the model
    if settings.draft_steps is not None:
        return _speculative_text(model, tokenizer, ids, settings, stream) if recurrent else _fixed_depth_refusal()
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
        kwargs.update(num_steps=settings.recurrence, exit_rule=settings.exit_rule, warm_start=settings.warm_start)
        kwargs[CACHE_ARG] = _cache(model, ids, settings)
    elif settings.exit or settings.warm_start or settings.compile:
        _fixed_depth_refusal()
    if stream:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    new = output.sequences[0, ids.shape[1] :]
    steps = output.get("steps_per_token")
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True).strip(),
        tokens=len(new),
        seconds=seconds,
        steps_per_token=steps[0, : len(new)].tolist() if steps is not None else None,
    )


def _cache(model, ids: torch.Tensor, settings: GenerationSettings):
    """The KV cache for one `generate` call: static with a compiled step (reused across calls) or dynamic."""
    if not settings.compile:
        return RecurrentCache(model.config, policy=settings.cache_policy)
    length = ids.shape[1] + settings.max_new_tokens
    return decoding_cache(model, ids.shape[0], length, settings.recurrence, settings.cache_policy)


def _fixed_depth_refusal():
    raise RecurfitError(
        "--exit, --warm-start, --draft-steps and --compile need a recurrent model; this one has a fixed depth."
    )


def _speculative_text(model, tokenizer, ids: torch.Tensor, settings: GenerationSettings, stream: bool) -> Generation:
    """Greedy self-speculative decoding; with `stream`, the text is printed when it is complete (verification
    may still roll drafted tokens back, so nothing can be shown earlier)."""
    start = time.perf_counter()
    output = speculative_generate(
        model,
        ids,
        max_new_tokens=settings.max_new_tokens,
        num_steps=settings.recurrence,
        draft_steps=settings.draft_steps,
        lookahead=settings.lookahead,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    seconds = time.perf_counter() - start
    new = output.sequences[0, ids.shape[1] :]
    if tokenizer.eos_token_id is not None and (new == tokenizer.eos_token_id).any():
        new = new[: int((new == tokenizer.eos_token_id).nonzero()[0]) + 1]
    if stream:
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamer.put(ids[0].cpu())
        streamer.put(new.cpu())
        streamer.end()
    return Generation(
        tokenizer.decode(new, skip_special_tokens=True).strip(),
        len(new),
        seconds,
        None,
        acceptance_rate=output.acceptance_rate,
    )

"""The lm-eval model type `recurfit`: lm-eval's own HFLM, with the test recurrence as an argument.

    lm_eval --model recurfit --model_args pretrained=MODEL,num_steps=8 --tasks arc_easy
    lm_eval --model recurfit --model_args pretrained=MODEL,num_steps=32,exit=kl:5e-4,state_init=previous ...

Everything HFLM does (batching, right-padded log-likelihoods, left-padded generation, stop sequences, chat
templates) is lm-eval's; this class only passes `num_steps` (and, on request, a zero initial state) to every
forward, and the decoding settings (adaptive `exit`, warm starts) to `generate`. A fixed-depth model (the
parent) works too: it is evaluated without `num_steps`.

`add_bos_token=True` (the paper authors' setting) means what it means to HFLM loading a tokenizer by name,
`AutoTokenizer.from_pretrained(..., add_bos_token=True)`: every encoded prompt starts with the BOS token. HFLM
ignores the flag for a tokenizer passed as an object, which it uses as it is; RecurfitLM applies it to a copy.
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager

import torch

from ..extras import require

require("The lm-eval model type `recurfit`", "eval", modules=("lm_eval",))
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from ..generation.exit import ExitRule  # noqa: E402
from ..model.modeling import RecurrentForCausalLM  # noqa: E402

STATE_INITS = ("random", "zeros", "previous")


@register_model("recurfit")
class RecurfitLM(HFLM):
    def __init__(
        self,
        pretrained,
        num_steps: int | None = None,
        state_init: str = "random",
        exit: str | None = None,
        min_steps: int = 2,
        exit_check_every: int = 1,
        compile: bool | str = False,
        **kwargs,
    ):
        """`num_steps`: test recurrence (default: the model's `mean_recurrence`). `state_init`: "random" draws
        s_0 as in training; "zeros" makes every request independent of what it is batched with (it sets the model's
        `state_init_std` to 0); "previous" also starts each generated token's recurrence from the previous
        token's final state (warm start). `exit`: adaptive depth for generated tokens, as on the CLI
        ("kl:5e-4", "argmax:3"), no earlier than `min_steps`, asking whether all rows settled every
        `exit_check_every` steps. `compile`: generate through a compiled static-cache
        decoding step (with `exit` too: the same tokens and depths); log-likelihoods run eagerly."""
        if state_init not in STATE_INITS:
            raise ValueError(f"state_init must be one of {STATE_INITS}, got {state_init!r}.")
        if kwargs.get("trust_remote_code"):
            raise ValueError("--model recurfit never runs a model folder's own code: leave trust_remote_code out.")
        self.exit_rule = ExitRule.parse(exit, min_steps=int(min_steps), check_every=int(exit_check_every))
        # lm-eval's model_args arrive as strings: true/false, or a torch.compile backend's name
        self.compile = {"true": True, "1": True, "false": False, "0": False}.get(str(compile).lower(), compile)
        if kwargs.get("add_bos_token") is not None and not isinstance(kwargs.get("tokenizer"), (str, type(None))):
            kwargs["tokenizer"] = with_bos(kwargs["tokenizer"], kwargs["add_bos_token"])
        kwargs.setdefault("backend", "causal")
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, **kwargs)
        self.num_steps = None if num_steps is None else int(num_steps)
        self.state_init = state_init
        if state_init in ("zeros", "previous") and self.recurrent:
            self.model.config.state_init_std = 0.0  # s_0 = 0 in every forward, generate's included

    @property
    def recurrent(self) -> bool:
        return isinstance(self.model, RecurrentForCausalLM)

    def _depth_kwargs(self) -> dict:
        return {"num_steps": self.num_steps} if self.recurrent else {}  # None: the model's mean recurrence

    def _decoding_kwargs(self) -> dict:
        if not self.recurrent:
            return {}
        decoding = {"exit_rule": self.exit_rule, "warm_start": self.state_init == "previous"}
        return {**self._depth_kwargs(), **decoding, **({"compile": self.compile} if self.compile else {})}

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        with torch.no_grad(), self._autocast():
            return self.model(inps, **self._depth_kwargs()).logits

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        return super()._model_generate(context, max_length, stop, **generation_kwargs, **self._decoding_kwargs())

    def _autocast(self):
        return torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        )

    # ------------------------------------------------------------ progress
    # lm-eval's own bars (tqdm) are off when TQDM_DISABLE is set, as the CLI does without --verbose; recurfit's
    # bar (`progress`: a progress.progress_bar and a label, set by task_sweep) counts the answered requests.

    progress = None

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self._counted("log-likelihood requests", requests):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or _quiet())

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        with self._counted("rolling log-likelihood requests", requests):
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or _quiet())

    def generate_until(self, requests, disable_tqdm: bool = False):
        with self._counted("generation requests", requests):
            return super().generate_until(requests, disable_tqdm=disable_tqdm or _quiet())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        # loglikelihood_rolling asks for a bar per window batch (disable_tqdm=False) whatever it was given
        return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm or _quiet(), override_bs=override_bs)

    @contextmanager
    def _counted(self, kind: str, requests):
        """While lm-eval answers `requests`, recurfit's bar advances once per answer (lm-eval reports each to its
        cache hook)."""
        if self.progress is None or not requests:
            yield
            return
        bar, label = self.progress
        task = bar.add_task(f"{label}: {kind}", total=len(requests))
        hook = self.cache_hook
        self.cache_hook = _AdvancingHook(hook, lambda: bar.advance(task))
        try:
            yield
        finally:
            self.cache_hook = hook

    def get_model_info(self) -> dict:
        exit = None if self.exit_rule is None else f"{self.exit_rule}"
        info = {"num_steps": self.num_steps, "state_init": self.state_init, "exit": exit, "compile": self.compile}
        return {**super().get_model_info(), **info}


def _quiet() -> bool:
    return bool(os.environ.get("TQDM_DISABLE"))


class _AdvancingHook:
    """lm-eval's cache hook, which also advances a progress bar for every answered request."""

    def __init__(self, inner, advance):
        self.inner, self.advance = inner, advance

    def add_partial(self, attr, request, result) -> None:
        self.advance()
        self.inner.add_partial(attr, request, result)


def with_bos(tokenizer, add_bos_token: bool):
    """A copy of `tokenizer` that prepends BOS to every encoding, or never does, as
    `AutoTokenizer.from_pretrained(name, add_bos_token=…)` would have loaded it. A tokenizer without a BOS
    token (Qwen's) is returned as it is: there is nothing to prepend."""
    if tokenizer.bos_token is None:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_bos_token = add_bos_token
    if add_bos_token and tokenizer("a")["input_ids"][:1] != [tokenizer.bos_token_id]:
        raise ValueError(f"{type(tokenizer).__name__} does not prepend its BOS token when asked (add_bos_token=True).")
    return tokenizer

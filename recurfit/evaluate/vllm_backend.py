"""`recurfit eval tasks --backend vllm`: the tasks through vLLM, with lm-eval's own `vllm` model type.

lm-eval's `VLLM` (its tokenisation, stop sequences, truncation, log-likelihoods from prompt log-probabilities) is
pointed at the saved folder; recurfit's vLLM plugin (recurfit.serving, registered by entry point when vLLM starts)
serves it. lm-eval builds the sampling parameters itself, so a request cannot name its depth here: each r gets
its own engine, started with `hf_overrides={"mean_recurrence": r, "max_recurrence": r}` (no KV caches for deeper
steps) and shut down before the next one: an idle CPU engine's worker keeps a core busy. `state_init="zeros"`
serves with `state_init_std` 0, as the default backend's `zeros` does; with "random" vLLM draws s_0 from its own
generator (the same distribution as recurfit's, not the same draws).

Nothing here imports vLLM or torch until an engine is started: `check_installed` answers from the package index.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import RecurfitError

SETUP = "./scripts/setup-vllm.sh"
STATE_INITS = ("random", "zeros")


def check_installed() -> None:
    """A one-line RecurfitError naming the fix when vLLM is not importable here."""
    if importlib.util.find_spec("vllm") is None:
        raise RecurfitError(
            f"--backend vllm: vLLM is not installed in this environment; run {SETUP} and use "
            ".venv-vllm/bin/recurfit (or install vllm into this one)."
        )


@dataclass
class ServedFolder:
    """A model folder (or Hub id) that vLLM loads, and its model on the meta device: what the sweep's rows count
    (parameters, FLOPs) and whether it is recurrent, without loading its weights here."""

    path: str
    meta: object
    engine_args: dict = field(default_factory=dict)  # more vllm.LLM arguments (dtype, enforce_eager, …)

    @classmethod
    def load(cls, path: str | None, **engine_args) -> ServedFolder:
        from ..model.loading import load_config, meta_model, resolve  # importing the model registers its Auto classes

        resolved = resolve(path)  # the folder's own code (auto_map) is never run: load_config refuses it
        return cls(resolved, meta_model(load_config(resolved)), dict(engine_args))

    @property
    def recurrent(self) -> bool:
        return getattr(self.meta.config, "model_type", None) == "recurfit"


@contextmanager
def vllm_lm(
    served: ServedFolder,
    *,
    num_steps: int | None,
    state_init: str = "random",
    max_length: int | None = None,
    seed: int = 0,
    **lm_args,
) -> Iterator[object]:
    """lm-eval's `VLLM` on `served` at recurrence `num_steps` (None: a fixed-depth model, or the folder's own
    mean recurrence), shut down on leaving."""
    check_installed()
    if state_init not in STATE_INITS:
        raise RecurfitError(f"--backend vllm: state_init must be one of {STATE_INITS}, not {state_init!r}.")
    from lm_eval.models.vllm_causallms import VLLM

    overrides = {}
    if served.recurrent:
        r = int(num_steps) if num_steps is not None else served.meta.config.mean_recurrence
        overrides["mean_recurrence"] = overrides["max_recurrence"] = r  # this r only: no deeper steps' KV caches
        if state_init == "zeros":
            overrides["state_init_std"] = 0.0
    lm = VLLM(
        pretrained=served.path,
        max_length=max_length,
        seed=seed,
        hf_overrides=overrides,
        **served.engine_args,
        **lm_args,
    )
    try:
        yield lm
    finally:
        shutdown(lm)


def shutdown(lm) -> None:
    """Stop the engine's worker (on a CPU an idle one keeps a core busy) and let its memory go."""
    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    lm.model = None
    gc.collect()

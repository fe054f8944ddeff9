"""`recurfit eval tasks --backend vllm`: the tasks through vLLM, with lm-eval's own `vllm` model type.

lm-eval's `VLLM` (its tokenisation, stop sequences, truncation, log-likelihoods from prompt log-probabilities) is
pointed at the saved folder; recurfit's vLLM plugin (recurfit.serving, registered by entry point when vLLM starts)
serves it. lm-eval builds the sampling parameters itself; the engine it starts is wrapped (`AtDepth`) so that every
request it sends names the sweep's current depth (`SamplingParams.extra_args["num_steps"]`, recurfit.serving.depth).

Each request runs to its own depth, so one engine started with `hf_overrides={"mean_recurrence": m,
"max_recurrence": m}` (m the deepest r; no KV caches for deeper steps) serves every r of the sweep
(`sweep_engines`): one start instead of one per r. An engine is shut down before the next starts: an idle CPU
engine's worker keeps a core busy. Prefix caching shares KV blocks only between requests of one depth (the
engine salts each request's cache by its depth, recurfit.serving.scheduler).

`state_init="zeros"` serves with `state_init_std` 0, as the default backend's `zeros` does; with "random" vLLM
draws s_0 from its worker's generator (the same distribution as recurfit's, not the same draws), whose draws for
one r of a shared engine follow those of the r before.

Nothing here imports vLLM or torch until an engine is started: `check_installed` answers from the package index.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
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

    def depth(self, r: int | None) -> int | None:
        """The recurrence a request for `r` runs at: r, or the folder's mean recurrence for None; None for a
        fixed-depth model."""
        if not self.recurrent:
            return None
        return int(r) if r is not None else self.meta.config.mean_recurrence


class AtDepth:
    """A `vllm.LLM` whose `generate` gives every request `num_steps` (when set) as its depth: lm-eval's `VLLM`
    builds its SamplingParams itself and hands them to `generate`, so they get the depth here, on copies. Under
    TQDM_DISABLE (the CLI without --verbose) it also asks for no progress bar: vLLM divides by a bar's elapsed
    time, which a bar that tqdm disabled leaves at 0."""

    def __init__(self, llm, num_steps: int | None = None):
        self.llm = llm
        self.num_steps = num_steps

    def generate(self, prompts, sampling_params=None, **kwargs):
        if self.num_steps is not None and sampling_params is not None:
            sampling_params = at_depth(sampling_params, self.num_steps)
        if os.environ.get("TQDM_DISABLE"):
            kwargs["use_tqdm"] = False
        return self.llm.generate(prompts, sampling_params, **kwargs)

    def __getattr__(self, name):  # everything else is the engine's (llm_engine, get_tokenizer, …)
        return getattr(self.llm, name)


def at_depth(sampling_params, num_steps: int):
    """`sampling_params` (one or a list; lm-eval repeats one object for a batch) as copies whose `extra_args` name
    `num_steps`, each distinct object copied once."""
    from ..serving.depth import NUM_STEPS

    copies: dict[int, object] = {}

    def copy(params):
        if id(params) not in copies:
            copied = params.clone()
            copied.extra_args = {**(params.extra_args or {}), NUM_STEPS: num_steps}
            copies[id(params)] = copied
        return copies[id(params)]

    if isinstance(sampling_params, list):
        return [copy(params) for params in sampling_params]
    return copy(sampling_params)


@contextmanager
def vllm_lm(
    served: ServedFolder,
    *,
    depths: Sequence[int | None] = (None,),
    state_init: str = "random",
    max_length: int | None = None,
    seed: int = 0,
    **lm_args,
) -> Iterator[object]:
    """lm-eval's `VLLM` on `served`, its engine able to serve every recurrence in `depths` (None: the folder's own
    mean recurrence) and no deeper; its requests run at `lm.model.num_steps` (set it before each run; it starts at
    the deepest). Shut down on leaving."""
    check_installed()
    if state_init not in STATE_INITS:
        raise RecurfitError(f"--backend vllm: state_init must be one of {STATE_INITS}, not {state_init!r}.")
    from lm_eval.models.vllm_causallms import VLLM

    overrides = {}
    deepest = None
    if served.recurrent:
        deepest = max(served.depth(r) for r in depths)
        overrides["mean_recurrence"] = overrides["max_recurrence"] = deepest  # no deeper steps' KV caches
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
    lm.model = AtDepth(lm.model, deepest)
    try:
        yield lm
    finally:
        shutdown(lm)


@contextmanager
def sweep_engines(served: ServedFolder, depths: Sequence[int | None], **lm_args) -> Iterator[Callable]:
    """`lm_at(max_length, r)`: a context manager giving lm-eval's `VLLM` on `served` at recurrence r, for runs that
    ask for the recurrences of `depths` in turn. One engine serves every r of `depths` (each request names its
    depth) and stays open while the runs keep its `max_length`. Every engine is shut down when the next starts,
    and on leaving."""
    shared = served.recurrent
    engine: dict = {"key": None, "lm": None}
    with ExitStack() as stack:

        @contextmanager
        def lm_at(length: int | None, r: int | None) -> Iterator[object]:
            key = (length, tuple(depths) if shared else (r,))
            if engine["key"] != key:
                stack.close()  # the previous engine first: two would share the cores and the memory
                engine["key"] = None
                engine["lm"] = stack.enter_context(vllm_lm(served, depths=key[1], max_length=length, **lm_args))
                engine["key"] = key
            engine["lm"].model.num_steps = served.depth(r)
            yield engine["lm"]

        yield lm_at


def shutdown(lm) -> None:
    """Stop the engine's worker (on a CPU an idle one keeps a core busy) and let its memory go."""
    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    lm.model = None
    gc.collect()
